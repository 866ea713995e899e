"""Mixture of experts (Kimi Linear; DeepSeek-V3 style routing) with shared experts.

The routing is the reference's (reference/layers/moe.py `route`, all fp32): sigmoid scores plus
the correction bias choose the top-k experts within the best groups; the chosen experts' raw
scores, normalised and scaled, weight their SwiGLU outputs, summed in increasing expert index,
and the shared expert's output is added last.

Program: ROUTER_SCORE records, spread over the SMs, each score a block of experts for all N rows
(the fp32 router logits [N, E]: 2.4 MB of fp32 router weight per layer at the published size, too
much for one SM); then one ROUTER instruction reads the logits and writes the expert ids
[N, top_k], their weights and the step's work list at run time.
The work list has one row per expert slot, W = min(E, N top_k) of them (no step routes more
distinct experts): row w = [expert, m, p_0 .. p_{m-1}, -1 ...] for the w-th smallest routed expert,
p = n top_k + s for each of the m (row n, top-k slot s) pairs routed to it in increasing p, and
[-1, 0, -1 ...] past the routed experts (`work_list`). The program issues EXPERT_GATEUP and
EXPERT_DOWN slabs per work slot, not per expert: a slot's records point at expert 0's matrix and
are bound at run time to the slot's expert (its matrix is MOE_X_STRIDE elements per expert
further, header), and a slot past the routed experts does nothing and streams nothing; so a step
issues instructions, and reads weights, in proportion to the routed experts. The shared expert
(packed as expert E, activation slot top_k) has its own slabs (SLOT = -1, every row).
MOE_COMBINE adds the weighted sum into h. Packed per expert x: gateup [2 I, H] (layers/swiglu.py
block order), down [H, I]. fp32 router table row: W_r [E, H] then the bias [E].
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from megakernel.common.errors import ConfigError, positive
from megakernel.isa.records import GATEUP_BLOCK, ROW_ALIGN
from megakernel.isa.registry import MATVEC, OpSpec, register
from megakernel.isa.stages import Instr, PlanError, ProgramError, Stage
from megakernel.kernel.host.moe_index import ROUTER_SIGNALS, bind_counter, x_stride
from megakernel.layers.base import CONST, LayerKind, Need, StepShape, register_kind
from megakernel.layers.swiglu import gateup_pairs_error, gateup_rows

EXPERT_SLABS = 8  # at most this many slabs per expert matrix
SHARED = -1  # the SLOT of the shared expert's records


@dataclass(frozen=True)
class MoEConfig:
    """Routed SwiGLU experts with sigmoid, bias-corrected, group-limited top-k routing plus
    always-on shared experts (Kimi / DeepSeek-V3 style)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int = 1  # shared MLP width = intermediate_size * num_shared_experts
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        positive(self, "num_experts", "top_k", "intermediate_size", "n_group", "topk_group")
        if self.num_shared_experts < 0:
            raise ConfigError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.num_experts % self.n_group:
            raise ConfigError(f"num_experts ({self.num_experts}) must be a multiple of n_group "
                              f"({self.n_group})")
        if self.num_experts // self.n_group < 2:
            raise ConfigError("group-limited routing needs at least 2 experts per group")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.top_k > self.num_experts // self.n_group * self.topk_group:
            raise ConfigError(f"top_k ({self.top_k}) exceeds the experts in the "
                              f"{self.topk_group} chosen groups")

    @property
    def slots(self) -> int:
        """Expert slots per row: top_k routed, then the shared expert."""
        return self.top_k + (1 if self.num_shared_experts else 0)

    def work_slots(self, rows: int) -> int:
        """Work-list slots of a step of `rows` activation rows: the most distinct experts the
        rows can pick."""
        return min(self.num_experts, rows * self.top_k)

    def expected_experts(self, rows: int) -> float:
        """Distinct experts `rows` rows pick in expectation under uniform routing (each expert
        is missed by a row with probability 1 - top_k / E)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** rows)


def expert_stride(e: MoEConfig, hidden: int, quant=None) -> int:  # noqa: ANN001 (Fp8Format)
    """Elements from expert x's packed matrices to expert x + 1's: gateup [2 I, H] then down
    [H, I], back to back, each from an aligned start (an FP8 model's with its scale block before
    it; moe_index.x_stride, the kernel's); `MoE.stages` checks the layout."""
    return x_stride(e.intermediate_size, hidden, quant)


def work_list(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids [N, top_k] -> the work list int32 [W, 2 + N] (module docstring)."""
    n, k = ids.shape
    slots = min(num_experts, n * k)
    out = torch.full((slots, 2 + n), -1, dtype=torch.int32)
    out[:, 1] = 0
    flat = ids.reshape(-1)
    for w, x in enumerate(torch.unique(flat).tolist()):  # ascending
        pairs = (flat == x).nonzero().reshape(-1)  # p = n top_k + s, ascending
        out[w, 0], out[w, 1] = x, len(pairs)
        out[w, 2 : 2 + len(pairs)] = pairs.to(torch.int32)
    return out

ROUTER_SCORE = register(OpSpec(
    31, "ROUTER_SCORE", "moe", "RMSNorm(h) -> fp32 router logits of a block of experts, all rows",
    (
        ("NORM_OFF", "weights: the block's RMSNorm [H]"),
        ("IN_OFF", "f32: h [N, H]"),
        ("K", "H"),
        ("ROUTER_OFF", "f32: router weight [E, H] (fp32; its bias [E] follows)"),
        ("E0", "first expert of the block"),
        ("NE", "experts in the block"),
        ("OUT_OFF", "f32: router logits [N, E]"),
    ),
    notes="logits[n, e] = W_r[e] . bf16(RMSNorm(h[n])) in fp32 for e in [E0, E0 + NE), all N "
    "rows; the block's NE x K fp32 router rows are prefetched when the CTA reaches the record.",
    reach=True, device=True, handler="moe_router.MoERouter"))
ROUTER = register(OpSpec(
    25, "ROUTER", "moe", "router logits -> group-limited top-k expert ids, weights, work list",
    (
        ("SCORES_OFF", "f32: router logits [N, E] (ROUTER_SCORE)"),
        ("BIAS_OFF", "f32: e_score_correction_bias [E]"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
        ("WTS_OFF", "f32: expert weights [N, top_k]"),
        ("WORK_OFF", "i32: the work list [SLOTS, 2 + N]"),
        ("SLOTS", "work-list slots W = min(E, N top_k)"),
    ),
    notes="All N rows: s = sigmoid(logits); choice = s + bias; the header's "
    "MOE_TOPK_GROUP best of MOE_N_GROUP groups (group score: sum of its top-2 choices), then the "
    "top_k experts of those groups by choice (ties: the lower expert id); weights "
    "s_e / (sum + 1e-20) * scaling (header). Then the whole work list: row w = [the w-th "
    "smallest routed expert, m, its m pairs p = n top_k + s ascending, -1 ...], rows past the "
    "routed experts [-1, 0, -1 ...].", device=True, handler="moe_router.MoERouter"))
_EXPERT = (("SLOT", "work-list slot bound at run time (-1: the shared expert, every row)"),
           ("WORK_OFF", "i32: the work list [W, 2 + N]"))
EXPERT_GATEUP = register(OpSpec(
    26, "EXPERT_GATEUP", "moe", "gate/up slab of the expert bound to a work-list slot, for the "
    "rows routed to it", MATVEC + _EXPERT,
    notes="Slot row [x, m, p...] of the work list (x = -1: no work, nothing streamed); the slab "
    "is W + x * MOE_X_STRIDE (W: expert 0's; the shared expert: its own, x = 0). For each pair "
    "p = n top_k + s (shared: every n, s = top_k), RMSNorm(h[n]) -> slab of the expert's "
    "interleaved gate/up -> act_moe[n, s, ROW0/2 + c] (bf16 [N, top_k + 1, I_e]).",
    slab=True, matvec="moe.ExpertGateUp", device=True))
EXPERT_DOWN = register(OpSpec(
    27, "EXPERT_DOWN", "moe", "down slab of the expert bound to a work-list slot, for the rows "
    "routed to it", MATVEC + _EXPERT,
    notes="Binding and rows as EXPERT_GATEUP; IN_OFF = bf16 act_moe [N, top_k + 1, I_e], "
    "OUT_OFF = f32 moe_y [N, top_k + 1, H]: moe_y[n, s, ROW0 + r] = acc.", slab=True,
    matvec="moe.ExpertDown", device=True))
MOE_COMBINE = register(OpSpec(
    28, "MOE_COMBINE", "moe", "weighted sum of the routed experts (+ shared) added into h",
    (
        ("ROW0", "first column of h"),
        ("NROWS", "columns"),
        ("Y_OFF", "f32: moe_y [N, top_k + 1, H]"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
        ("WTS_OFF", "f32: expert weights [N, top_k]"),
        ("OUT_OFF", "f32: h [N, H]"),
    ),
    notes="h[n, cols] += (sum over the top_k slots in increasing expert id of w * moe_y[n, s]) + "
    "moe_y[n, top_k] (the shared expert, header MOE_SHARED = 1).", device=True,
    handler="moe.Experts"))


@register_kind
class MoE(LayerKind):
    name = "moe"
    config = MoEConfig
    fp32_params = ("gate.weight", "gate.e_score_correction_bias")
    flow = {"ROUTER_SCORE": None, "ROUTER": "ROUTER_SCORE", "EXPERT_GATEUP": "ROUTER",
            "EXPERT_DOWN": "EXPERT_GATEUP", "MOE_COMBINE": "EXPERT_DOWN"}

    @classmethod
    def kernel_constants(cls, c) -> tuple[int, ...]:  # noqa: ANN001
        # ..., then the router's norm_topk_prob and routed_scaling_factor (its f32 bits)
        return (c.num_experts, c.top_k, c.intermediate_size, c.n_group, c.topk_group,
                int(c.num_shared_experts > 0), int(c.norm_topk_prob), f32_bits(
                    c.routed_scaling_factor))

    @classmethod
    def matvec_shapes(cls, spec) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001
        inter, h = spec.constants(cls.name)[2], spec.hidden  # one expert's [2 I, H], [H, I]
        return {"EXPERT_GATEUP": [(h, 2 * inter)], "EXPERT_DOWN": [(inter, h)]}

    @classmethod
    def kernel_header(cls, spec) -> dict[str, int]:  # noqa: ANN001 (KernelSpec)
        e, top_k, inter, n_group, topk_group, shared, norm, scale_bits = spec.constants(cls.name)
        return dict(MOE_E=e, MOE_TOPK=top_k, MOE_I=inter, MOE_N_GROUP=n_group,
                    MOE_TOPK_GROUP=topk_group, MOE_SHARED=shared, MOE_NORM=norm,
                    MOE_SCALE_F32_BITS=scale_bits,
                    MOE_X_STRIDE=x_stride(inter, spec.hidden, spec.quant))

    @classmethod
    def check_kernel_record(cls, d: dict, spec) -> str:  # noqa: ANN001 (KernelSpec)
        return gateup_pairs_error(d) if d["OPCODE"] == EXPERT_GATEUP else ""

    @classmethod
    def check(cls, blk, model) -> None:  # noqa: ANN001
        e = blk.cfg
        if e.num_shared_experts > 1:
            raise ConfigError(f"{e.num_shared_experts} shared experts: megakernel supports at "
                              "most one (it runs as expert slot top_k)")
        if e.intermediate_size % GATEUP_BLOCK:
            raise ConfigError(f"moe_intermediate_size = {e.intermediate_size} must be a multiple "
                              f"of {GATEUP_BLOCK}")

    @classmethod
    def experts(cls, e: MoEConfig) -> range:
        """Packed experts: the routed ones, then (index E) the shared one."""
        return range(e.num_experts + (1 if e.num_shared_experts else 0))

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        e, h = blk.cfg, model.hidden_size
        out: dict[str, tuple[int, ...]] = {"gate.weight": (e.num_experts, h),
                                           "gate.e_score_correction_bias": (e.num_experts,)}
        for x in range(e.num_experts):
            out.update({f"experts.{x}.w1.weight": (e.intermediate_size, h),
                        f"experts.{x}.w2.weight": (h, e.intermediate_size),
                        f"experts.{x}.w3.weight": (e.intermediate_size, h)})
        if e.num_shared_experts:
            i = e.intermediate_size * e.num_shared_experts
            out.update({"shared_experts.gate_proj.weight": (i, h),
                        "shared_experts.up_proj.weight": (i, h),
                        "shared_experts.down_proj.weight": (h, i)})
        return out

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        if local == "gate.e_score_correction_bias":
            return "bias"
        return "out" if local.endswith(("w2.weight", "down_proj.weight")) else "proj"

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        e, h = blk.cfg, model.hidden_size
        out = []
        for x in cls.experts(e):
            out += [(f"x{x}.gateup", (2 * e.intermediate_size, h)),
                    (f"x{x}.down", (h, e.intermediate_size))]
        return out

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return [n for n in cls.shapes(blk, model) if n.startswith(("experts.", "shared_experts."))]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        e = blk.cfg
        names = [(f"experts.{x}.w1.weight", f"experts.{x}.w3.weight", f"experts.{x}.w2.weight")
                 for x in range(e.num_experts)]
        if e.num_shared_experts:
            names.append(tuple(f"shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")))
        out = {}
        for x, (g, u, d) in enumerate(names):
            out[f"x{x}.gateup"] = gateup_rows(w(g), w(u))
            out[f"x{x}.down"] = w(d)
        return out

    @classmethod
    def tables(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"router": torch.cat((w("gate.weight").reshape(-1),
                                     w("gate.e_score_correction_bias")))}

    # ---- buffers -----------------------------------------------------------------------------
    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        e, n, h = blk.cfg, shape.rows, model.hidden_size
        return [Need("f32", "router", (e.num_experts * h + e.num_experts,), CONST, const=True,
                     table="moe"),
                Need("f32", "moe_scores", (n, e.num_experts)), Need("f32", "moe_w", (n, e.top_k)),
                Need("f32", "moe_y", (n, e.slots, h)),
                Need("bf16", "act_moe", (n, e.slots, e.intermediate_size)),
                Need("i32", "moe_ids", (n, e.top_k)),
                Need("i32", "moe_work", (e.work_slots(n), 2 + n))]

    # ---- program -----------------------------------------------------------------------------
    @classmethod
    def header(cls, blk, model) -> dict[str, int]:  # noqa: ANN001
        e = blk.cfg
        return dict(MOE_E=e.num_experts, MOE_TOPK=e.top_k, MOE_I=e.intermediate_size,
                    MOE_N_GROUP=e.n_group, MOE_TOPK_GROUP=e.topk_group,
                    MOE_NORM=int(e.norm_topk_prob), MOE_SHARED=int(e.num_shared_experts > 0),
                    MOE_SCALE_F32_BITS=f32_bits(e.routed_scaling_factor),
                    MOE_X_STRIDE=expert_stride(e, model.hidden_size, model.quant))

    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        """Router logits (experts over the SMs) -> router -> expert gate/up slabs -> expert down
        slabs -> combine (added into h)."""
        e, layer, key = blk.cfg, blk.layer, blk.key
        n, hid, lay, ctr = ctx.rows, ctx.model.hidden_size, ctx.lay, ctx.ctr
        f32, bf, i32 = ctx.buf.f32, ctx.buf.bf16, ctx.buf.i32
        n_exp, norm = e.num_experts, lay[f"{key}.norm"].offset
        c_s, c_r, c_gu, c_dn, c_c = (ctr(f"L{layer}.score"), ctr(f"L{layer}.router"),
                                     ctr(f"L{layer}.xgu"), ctr(f"L{layer}.xdn"),
                                     ctr(f"L{layer}.down"))
        if bind_counter(1, c_gu) != c_r:  # the kernel finds the router's counter so
            raise PlanError(f"layer {layer}: the gate/up counter is not the router's + 1")
        router = f32["router"]
        router_off = router.offset + ctx.buf.row("moe", layer) * router.shape[1]
        scores = f32["moe_scores"].offset
        ids, work, slots = i32["moe_ids"].offset, i32["moe_work"].offset, e.work_slots(n)

        def mk_score(u0: int, u1: int) -> Instr:
            ne = u1 - u0  # experts [u0, u1): their fp32 router rows, prefetched at reach
            return Instr(ROUTER_SCORE, layer, dict(
                NORM_OFF=norm, IN_OFF=f32["h"].offset, K=hid, ROUTER_OFF=router_off, E0=u0,
                NE=ne, OUT_OFF=scores),
                wait=wait, signal=c_s, w_bytes=ne * hid * 4, l2_bytes=n * hid * 4 + hid * 2,
                store_bytes=n * ne * 4, fp32_flops=2.0 * n * ne * hid)

        def mk_router(u0: int, u1: int) -> Instr:
            # per row: sigmoid, group scores, topk_group + top_k selection passes over E
            return Instr(ROUTER, layer, dict(
                SCORES_OFF=scores, BIAS_OFF=router_off + n_exp * hid, IDS_OFF=ids,
                WTS_OFF=f32["moe_w"].offset, WORK_OFF=work, SLOTS=slots),
                wait=c_s, signal=c_r, l2_bytes=n * n_exp * 4, hbm_bytes=n_exp * 4,  # the bias
                store_bytes=n * e.top_k * 8 + slots * (2 + n) * 4,
                fp32_flops=float(n * n_exp * (8 + 2 * (e.topk_group + e.top_k))))

        out = [Stage(f"L{layer}.score", ROUTER_SCORE, layer, n_exp, True, mk_score, 1),
               Stage(f"L{layer}.router", ROUTER, layer, 1, False, mk_router)]
        ie, stride = e.intermediate_size, expert_stride(e, hid, ctx.model.quant)
        x0 = {m: lay[f"{key}.x0.{m}"].offset for m in ("gateup", "down")}
        if any(lay[f"{key}.x{x}.{m}"].offset != x0[m] + x * stride
               for x in cls.experts(e) for m in ("gateup", "down")):
            raise PlanError(f"layer {layer}: the experts' packed matrices are not "
                            f"{stride} elements apart (MOE_X_STRIDE)")
        # a slot is bound in expectation to expected_experts / W of the steps (uniform routing)
        bound = e.expected_experts(n) / slots

        def cut(rows: int, base: int) -> tuple[int, int]:
            """(units, rows per unit): an expert matrix is cut into at most EXPERT_SLABS slabs,
            so that hundreds of experts do not each become one slab per SM."""
            nb = rows // base
            k = max(x for x in range(1, EXPERT_SLABS + 1) if nb % x == 0)
            return k, rows // k

        gu_units, gu = cut(2 * ie, 2 * GATEUP_BLOCK)
        dn_units, dn_rows = cut(hid, ROW_ALIGN)
        # (slot, expert whose matrix the records point at): the work slots at expert 0, then
        # the shared expert at its own
        bindings = [(w, 0) for w in range(slots)]
        if e.num_shared_experts:
            bindings.append((SHARED, n_exp))

        def mk_gu(w: int, x: int):  # noqa: ANN202
            def mk(u0: int, u1: int) -> Instr:
                r0, rows = u0 * gu, (u1 - u0) * gu
                ins = ctx.matvec(EXPERT_GATEUP, layer, lay[f"{key}.x{x}.gateup"].offset, r0, rows,
                                 hid, norm, f32["h"].offset, bf["act_moe"].offset, c_r, c_gu,
                                 n * rows, SLOT=w, WORK_OFF=work)
                return _bound(ins, w, c_r, bound)
            return mk

        def mk_dn(w: int, x: int):  # noqa: ANN202
            def mk(u0: int, u1: int) -> Instr:
                r0, rows = u0 * dn_rows, (u1 - u0) * dn_rows
                ins = ctx.matvec(EXPERT_DOWN, layer, lay[f"{key}.x{x}.down"].offset, r0, rows,
                                 ie, -1, bf["act_moe"].offset, f32["moe_y"].offset, c_gu, c_dn,
                                 n * rows * 4, SLOT=w, WORK_OFF=work)
                return _bound(ins, w, c_r, bound)
            return mk

        for w, x in bindings:
            out.append(Stage(f"L{layer}.w{w}.gateup", EXPERT_GATEUP, layer, gu_units, True,
                             mk_gu(w, x), gu))
        for w, x in bindings:
            out.append(Stage(f"L{layer}.w{w}.down", EXPERT_DOWN, layer, dn_units, True,
                             mk_dn(w, x), dn_rows))

        def mk_comb(u0: int, u1: int) -> Instr:
            r0, rows = u0 * ROW_ALIGN, (u1 - u0) * ROW_ALIGN
            return Instr(MOE_COMBINE, layer, dict(
                ROW0=r0, NROWS=rows, Y_OFF=f32["moe_y"].offset, IDS_OFF=ids,
                WTS_OFF=f32["moe_w"].offset, OUT_OFF=f32["h"].offset),
                wait=c_dn, signal=c_c, l2_bytes=n * e.slots * rows * 4 + n * e.top_k * 8,
                store_bytes=n * rows * 4)

        out.append(Stage(f"L{layer}.combine", MOE_COMBINE, layer, hid // ROW_ALIGN, True, mk_comb,
                         ROW_ALIGN))
        return out, c_c

    @classmethod
    def slab_passes(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        """Expert 0's matrices once per work slot (their records are bound at run time), the
        other routed experts' never through a record's own W."""
        e = blk.cfg
        out = {f"x{x}.{m}": 0 for x in range(1, e.num_experts) for m in ("gateup", "down")}
        return out | {f"x0.{m}": e.work_slots(prog.rows) for m in ("gateup", "down")}

    @classmethod
    def binding(cls, d: dict, blk, prog) -> tuple[int, bool, bool] | None:  # noqa: ANN001
        """The router writes the work list; a routed slot's records read it (bound at run time;
        unbound, with no tiles, where the step's rows may pick fewer experts than its slots)."""
        if d["OPCODE"] == ROUTER:
            return d["WORK_OFF"], True, False
        if d["OPCODE"] in (EXPERT_GATEUP, EXPERT_DOWN) and d["SLOT"] != SHARED:
            return d["WORK_OFF"], False, blk.cfg.work_slots(prog.rows) > blk.cfg.top_k
        return None

    @classmethod
    def check_record(cls, d: dict, blk, prog, where: str) -> None:  # noqa: ANN001
        e, name, rows = blk.cfg, d["OPCODE"].name, prog.rows
        if name == "MOE_COMBINE":
            return
        f32 = prog.buffers.f32
        scores = f32["moe_scores"].offset
        router = f32["router"]
        router_off = router.offset + prog.buffers.row("moe", blk.layer) * router.shape[1]
        if name == "ROUTER_SCORE":
            if (d["ROUTER_OFF"], d["OUT_OFF"], d["K"]) != (router_off, scores,
                                                         prog.cfg.hidden_size):
                raise ProgramError(f"{where}: not the layer's router row, logits and width")
            if not 0 <= d["E0"] < d["E0"] + d["NE"] <= e.num_experts:
                raise ProgramError(f"{where}: experts [{d['E0']}, +{d['NE']}) outside "
                                   f"[0, {e.num_experts})")
            return
        work = prog.buffers.i32["moe_work"].offset
        if d["WORK_OFF"] != work:
            raise ProgramError(f"{where}: WORK_OFF {d['WORK_OFF']} is not the work list ({work})")
        if name == "ROUTER":
            if d["SLOTS"] != e.work_slots(rows):
                raise ProgramError(f"{where}: {d['SLOTS']} work slots, the step has "
                                   f"{e.work_slots(rows)}")
            bias = router_off + e.num_experts * prog.cfg.hidden_size
            if (d["SCORES_OFF"], d["BIAS_OFF"]) != (scores, bias):
                raise ProgramError(f"{where}: not the router logits or the layer's bias")
            return
        slot = d["SLOT"]
        if not (SHARED if e.num_shared_experts else 0) <= slot < e.work_slots(rows):
            raise ProgramError(f"{where}: slot {slot} outside the work list")
        if slot != SHARED:  # the loader waits on the router's counter for the binding
            bind = bind_counter(int(name == "EXPERT_DOWN"), d["WAIT_CID"])
            c = prog.counters[bind] if 0 <= bind < len(prog.counters) else None
            if c is None or (c.name, c.total) != (f"L{blk.layer}.router", ROUTER_SIGNALS):
                raise ProgramError(f"{where}: its binding counter ({bind}) is not the layer's "
                                   "router counter")
        x = e.num_experts if slot == SHARED else 0
        m = prog.layout[f"{blk.key}.x{x}.{'gateup' if name == 'EXPERT_GATEUP' else 'down'}"]
        if not m.offset <= d["W"] < m.offset + m.numel:
            raise ProgramError(f"{where}: slot {slot}'s slab is not in expert {x}'s matrix")

    @classmethod
    def coverage(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        return {"ROUTER_SCORE": blk.cfg.num_experts, "ROUTER": 1,
                "MOE_COMBINE": prog.cfg.hidden_size}

    @classmethod
    def cover(cls, d: dict, blk, prog) -> tuple[int, int]:  # noqa: ANN001
        if "ROW0" in d:
            return d["ROW0"], d["ROW0"] + d["NROWS"]
        if "E0" in d:  # ROUTER_SCORE: its experts
            return d["E0"], d["E0"] + d["NE"]
        return 0, 1

    @classmethod
    def step_bytes(cls, blk, prog) -> dict[str, float]:  # noqa: ANN001
        e = blk.cfg
        return {"weights": (e.num_experts * prog.cfg.hidden_size + e.num_experts) * 4}


def f32_bits(x: float) -> int:
    """The int32 whose bits are float32(x)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _bound(ins: Instr, slot: int, router: int, share: float) -> Instr:
    """An expert slab record of `slot`: its weight stream waits for the router's counter (the
    binding; the shared expert's is static) and its cost is weighted by the chance that the slot
    is bound."""
    if slot != SHARED:
        ins.stream_wait = router
    return _weighted(ins, 1.0 if slot == SHARED else share)


def _weighted(ins: Instr, share: float) -> Instr:
    """An expert slab's cost attributes times the chance that its slot is bound (streamed); its
    bytes rounded on the matrix's byte prefix, so that the slabs of any cut of a matrix sum to
    int(matrix bytes x share)."""
    lo = ins.operands["ROW0"] * ins.operands["K"] * 2
    ins.w_bytes = int((lo + ins.w_bytes) * share) - int(lo * share)
    ins.tensor_flops *= share
    ins.fp32_flops *= share
    return ins
