"""The driver-API runtime on a CPU machine: manifests, device checks and argument validation all
run (and refuse bad input with named errors) before any CUDA call; no DSL import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megakernel import isa
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.config.spec import PARAMS, KernelSpec
from megakernel.kernel.toolchain.tools import ToolError, parse_ptx_entries, parse_ptx_entry
from megakernel.launch.checks import ArgumentError, check_lengths, check_records, validate_args
from megakernel.launch.runtime import (
    DeviceInfo,
    KernelUnavailable,
    Manifest,
    ManifestError,
    arch_for_capability,
    check_device,
    load_manifest,
    parse_manifest,
)
from megakernel.models import preset

REPO = Path(__file__).resolve().parents[2]


def manifest_dict(arch: str = "sm_90a", batch: int = 2, tokens: int = 1,
                  model: str = "llama-tiny") -> dict:
    spec = make_spec(preset(model), batch, tokens, arch)
    return {
        "manifest_version": 1, "arch": arch, "symbol": "kernel_x", "cubin": "megakernel.cubin",
        "block": [spec.num_threads, 1, 1], "dynamic_smem_bytes": spec.smem_bytes,
        "params": [{"name": p.name, "kind": p.kind, "dtype": p.dtype, "size": p.size}
                   for p in PARAMS],
        "program_format_version": isa.FORMAT_VERSION, "fingerprint": "f" * 64,
        "spec": spec.to_dict(), "resources": {"registers": 100},
    }


def write_build(root: Path, data: dict) -> Path:
    d = root / data["arch"]
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps(data))
    (d / "megakernel.cubin").write_bytes(b"\x7fELF")
    return root


def tensors(spec: dict, s_max: int = 32, device: str = "cpu") -> dict[str, torch.Tensor]:
    s = KernelSpec.from_dict(spec)
    kv = (s.layers, s.batch, s.kv_heads, s_max, s.head_dim)
    return dict(
        program=torch.zeros(4, 3, isa.RECORD_WORDS, dtype=torch.int32, device=device),
        counters=torch.zeros(16, dtype=torch.int32, device=device),
        weights=torch.zeros(1024, dtype=torch.bfloat16, device=device),
        f32=torch.zeros(4096, dtype=torch.float32, device=device),
        bf16=torch.zeros(1024, dtype=torch.bfloat16, device=device),
        i32=torch.zeros(256, dtype=torch.int32, device=device),
        k_cache=torch.zeros(kv, dtype=torch.bfloat16, device=device),
        v_cache=torch.zeros(kv, dtype=torch.bfloat16, device=device),
        state=torch.zeros(0, dtype=torch.float32, device=device),
    )


# ---- manifests ----------------------------------------------------------------------------------
def test_load_manifest_finds_the_arch_subdir(tmp_path):
    root = write_build(tmp_path, manifest_dict("sm_100a"))
    m = load_manifest(root, "sm_100a")
    assert m.arch == "sm_100a" and m.rows == 2 and m.cubin_bytes() == b"\x7fELF"


def test_refuses_a_stale_program_version(tmp_path):
    d = manifest_dict()
    d["program_format_version"] = isa.FORMAT_VERSION - 1
    root = write_build(tmp_path, d)
    with pytest.raises(ManifestError, match="stale build.*rebuild"):
        load_manifest(root, "sm_90a")


def test_refuses_a_wrong_arch_cubin(tmp_path):
    root = write_build(tmp_path, manifest_dict("sm_100a"))
    (root / "sm_90a").mkdir()  # no sm_90a build here, only sm_100a
    with pytest.raises(KernelUnavailable, match="no sm_90a build"):
        load_manifest(root, "sm_90a")
    with pytest.raises(ManifestError, match="is for sm_100a, the device needs sm_90a"):
        load_manifest(root / "sm_100a", "sm_90a")
    m = Manifest(root / "sm_100a", manifest_dict("sm_100a"))
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)
    with pytest.raises(ManifestError, match="for sm_100a, but NVIDIA H200 is sm_90a"):
        check_device(m, h200, 132)


def test_refuses_damaged_or_foreign_manifests(tmp_path):
    d = manifest_dict()
    del d["symbol"]
    with pytest.raises(ManifestError, match="lacks symbol"):
        parse_manifest(d, tmp_path)
    d = manifest_dict()
    d["params"] = d["params"][:-1]
    with pytest.raises(ManifestError, match="rebuild"):
        parse_manifest(d, tmp_path)
    d = manifest_dict()
    d["arch"] = "sm_80"
    with pytest.raises(ManifestError, match="unsupported arch 'sm_80'"):
        parse_manifest(d, tmp_path)
    (tmp_path / "sm_90a").mkdir()
    (tmp_path / "sm_90a" / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path, "sm_90a")


def test_capability_to_arch():
    assert arch_for_capability((9, 0)) == "sm_90a"
    assert arch_for_capability((10, 0)) == "sm_100a"
    with pytest.raises(KernelUnavailable, match="8.0 is not a kernel target"):
        arch_for_capability((8, 0))
    with pytest.raises(KernelUnavailable, match="12.0"):
        arch_for_capability((12, 0))


def test_device_checks_co_residency_and_smem(tmp_path):
    m = Manifest(tmp_path, manifest_dict())
    dev = DeviceInfo("NVIDIA H100", (9, 0), 132, 232448)
    check_device(m, dev, 132)
    with pytest.raises(ArgumentError, match="133 CTA queues but NVIDIA H100 has 132 SMs"):
        check_device(m, dev, 133)
    small = DeviceInfo("NVIDIA H100", (9, 0), 132, 1024)
    with pytest.raises(ManifestError, match="shared memory"):
        check_device(m, small, 132)


# ---- arguments ----------------------------------------------------------------------------------
def test_validate_accepts_matching_cpu_tensors_without_cuda():
    spec = manifest_dict()["spec"]
    validate_args(spec, tensors(spec), lengths_off=128, require_cuda=False)


@pytest.mark.parametrize("name,bad,match", [
    ("f32", lambda t: t.to(torch.float16), r"f32 must be torch.float32, got torch.float16"),
    ("k_cache", lambda t: t.float(), r"k_cache must be torch.bfloat16"),
    ("program", lambda t: t.to(torch.int64), r"program must be torch.int32"),
    ("program", lambda t: t[..., :8], r"program must be \[num_sms, queue_len, 16\]"),
    ("k_cache", lambda t: t[:, :, :, :, :32], r"k_cache must be \[L, B, Hkv, S_max, D\]"),
    ("v_cache", lambda t: t.transpose(3, 4).contiguous().transpose(3, 4),
     r"v_cache must be contiguous"),
    ("f32", lambda t: t.view(64, 64), r"f32 must be a non-empty 1-D arena"),
])
def test_validate_rejects_bad_tensors(name, bad, match):
    spec = manifest_dict()["spec"]
    ts = tensors(spec)
    ts[name] = bad(ts[name])
    with pytest.raises(ArgumentError, match=match):
        validate_args(spec, ts, lengths_off=128, require_cuda=False)


def test_validate_rejects_a_larger_batch_than_built():
    spec = manifest_dict(batch=2)["spec"]
    big = tensors(manifest_dict(batch=4)["spec"])
    with pytest.raises(ArgumentError, match="holds batch 4 but the kernel was built for batch 2"):
        validate_args(spec, big, lengths_off=128, require_cuda=False)


def test_validate_rejects_cpu_tensors_for_a_launch():
    spec = manifest_dict()["spec"]
    with pytest.raises(ArgumentError, match="the kernel needs CUDA tensors; program, .* on cpu"):
        validate_args(spec, tensors(spec), lengths_off=128)


def test_validate_rejects_lengths_outside_the_arena():
    spec = manifest_dict()["spec"]
    with pytest.raises(ArgumentError, match="lengths_off 255 \\+ batch 2"):
        validate_args(spec, tensors(spec), lengths_off=255, require_cuda=False)


def test_lengths_must_leave_room_for_the_step():
    spec = manifest_dict(batch=2, tokens=4, model="qwen3-tiny")["spec"]
    check_lengths(spec, [0, 28], 32)
    with pytest.raises(ArgumentError, match="sequence 1: 29 cached \\+ 4 new tokens exceed"):
        check_lengths(spec, [0, 29], 32)
    with pytest.raises(ArgumentError, match="3 sequences but the kernel was built for batch 2"):
        check_lengths(spec, [0, 1, 2], 32)


# ---- PTX parsing --------------------------------------------------------------------------------
PTX = """
.version 8.8
.target sm_90a
.address_size 64
.visible .entry kern_a(
	.param .u64 .ptr .global .align 16 kern_a_param_0,
	.param .u32 kern_a_param_1,
	.param .align 8 .b8 kern_a_param_2[24]
)
.reqntid 128, 1, 1
{
	ret;
}
.visible .entry kern_b(
	.param .f32 kern_b_param_0
)
{
	ret;
}
"""


def test_ptx_entry_parser():
    a, b = parse_ptx_entries(PTX)
    assert a.name == "kern_a" and a.reqntid == (128, 1, 1)
    assert [(p.ptx_type, p.is_pointer, p.align, p.array, p.size) for p in a.params] == [
        ("u64", True, 16, None, 8), ("u32", False, None, None, 4), ("b8", False, 8, 24, 24)]
    assert b.name == "kern_b" and b.reqntid is None and b.params[0].size == 4
    assert parse_ptx_entry(PTX, "kern_b") is not None
    with pytest.raises(ToolError, match="expected one PTX entry, found 2"):
        parse_ptx_entry(PTX)


# ---- no DSL -------------------------------------------------------------------------------------
# a script prelude under which importing the DSL fails (what a GPU machine without it sees)
NO_DSL = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'cutlass' or name.startswith('cutlass.'):\n"
    "            raise ImportError('the DSL must not be imported')\n"
    "sys.meta_path.insert(0, Block())\n")


def test_runtime_and_op_import_without_the_dsl():
    code = (
        NO_DSL +
        "import megakernel.launch.runtime, megakernel.launch.torch_op\n"
        "import megakernel.serve.kernel_backend, megakernel.gpu_check\n"
        "import megakernel.kernel.config.spec\n"
        "import megakernel.kernel.toolchain.tools, megakernel.kernel.toolchain.jit\n"
        "assert not any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ---- records and limits the build bakes in ------------------------------------------------------
def _program(model: str = "llama-tiny", batch: int = 2, tokens: int = 1):
    from megakernel.executor import executor_gpu
    from megakernel.program.compiler import compile_program

    return compile_program(preset(model), batch, executor_gpu(8), tokens=tokens, max_seq_len=40)


def with_constants(spec: dict, kind: str, constants: list[int]) -> dict:
    """A manifest spec of the same build with `kind`'s constants replaced (another model)."""
    kinds = [[k, constants if k == kind else c] for k, c in spec["kinds"]]
    assert kind in {k for k, _ in kinds}, kind
    return {**spec, "kinds": kinds}


def _first(records: torch.Tensor, op: int) -> tuple[int, int]:
    sm, pos = (records[:, :, 0] == op).nonzero()[0].tolist()
    return sm, pos


def test_check_records_refuses_a_program_for_another_model_or_a_broken_slab():
    from megakernel.isa import Op, field_index

    spec = manifest_dict(batch=2, tokens=1, model="llama-tiny")["spec"]
    recs = _program().records()
    check_records(recs, spec)
    with pytest.raises(ArgumentError, match="K=512.*the program is for another model or build"):
        check_records(recs, with_constants(spec, "swiglu", [1024]))  # a build of a wider MLP
    with pytest.raises(ArgumentError, match="not whole heads of 128"):
        check_records(recs, manifest_dict(batch=2, model="qwen3-tiny")["spec"])
    cases = [
        (Op.GATEUP, "ROW0", 16, "not whole 16-row gate/up block pairs"),
        (Op.QKV, "ROW0", 32, "not whole heads of 64"),
        (Op.DOWN, "K", 8, "K=520"),
        (Op.ATTN_PARTIAL, "KV_HEAD", 2, "outside the build's B=2, Hkv=2"),
        (Op.EMBED, "N1", 1, "do not fit the build's N=2"),
    ]
    for op, field, delta, match in cases:
        bad = recs.clone()
        sm, pos = _first(bad, int(op))
        bad[sm, pos, field_index(op, field)] += delta
        with pytest.raises(ArgumentError, match=match):
            check_records(bad, spec)


def test_check_records_checks_the_mamba2_records():
    """A Nemotron-H program fits its build (PROJ of the Mamba2 width, out_proj K = H P, the
    MAMBA_CORE indices); a record past the build's groups, a projection of another width and a
    program of other Mamba2 heads are refused."""
    from megakernel.isa import Op, field_index

    spec = manifest_dict(batch=2, model="nemotron-h-tiny")["spec"]
    recs = _program("nemotron-h-tiny").records()
    check_records(recs, spec)
    cases = [
        (Op.MAMBA_CORE, "GROUP", 2, "group 2.*outside the build's B=2, G=2"),
        (Op.PROJ, "OUT_W", 16, "OUT_W=.*not a projection width"),
    ]
    for op, field, delta, match in cases:
        bad = recs.clone()
        sm, pos = _first(bad, int(op))
        bad[sm, pos, field_index(op, field)] += delta
        with pytest.raises(ArgumentError, match=match):
            check_records(bad, spec)
    with pytest.raises(ArgumentError, match="K=64.*the program is for another model or build"):
        # the same projection width (208) but H P = 32: another out_proj
        check_records(recs, with_constants(spec, "mamba2", [8, 4, 32, 2, 4]))


def test_check_records_checks_kimi_matrices_from_the_kinds_declarations():
    """A Kimi program fits a build of its model (the KDA and MLA projections, their out_proj,
    the experts' gate/up and down, as the kinds declare them from the spec's constants); an
    expert slab of another K, or a build of another expert width, is refused."""
    from megakernel.isa import Op, field_index
    from megakernel.kernel.config.model_spec import program_ops

    cfg = preset("kimi-linear-tiny")
    spec = make_spec(cfg, 2, 1, "sm_90a").to_dict()
    spec["ops"] = sorted(program_ops(cfg))  # as the build will once every handler exists
    recs = _program("kimi-linear-tiny").records()
    check_records(recs, spec)
    bad = recs.clone()
    sm, pos = _first(bad, int(Op.EXPERT_DOWN))
    bad[sm, pos, field_index(Op.EXPERT_DOWN, "K")] += 8
    with pytest.raises(ArgumentError, match="EXPERT_DOWN.*K=40"):
        check_records(bad, spec)
    with pytest.raises(ArgumentError, match="EXPERT_(GATEUP|DOWN).*another model or build"):
        check_records(recs, with_constants(spec, "moe", [8, 3, 48, 4, 2, 1, 1, 0]))


def test_validate_refuses_arenas_past_int32_offsets():
    spec = manifest_dict()["spec"]
    ts = tensors(spec)
    ts["f32"] = torch.empty(1 << 31, dtype=torch.float32, device="meta")
    with pytest.raises(ArgumentError, match="f32 arena has 2147483648 elements.*int32"):
        validate_args(spec, ts, lengths_off=128, require_cuda=False)


def test_spec_refuses_a_vocab_the_fp32_argmax_cannot_index():
    import dataclasses

    from megakernel.common.errors import SpecError

    cfg = dataclasses.replace(preset("llama-tiny"), vocab_size=(1 << 24) + 16)
    with pytest.raises(SpecError, match="vocab_size 16777232 > 16777216"):
        make_spec(cfg, 1, 1, "sm_90a")


def test_validate_checks_the_latent_cache_of_an_mla_build():
    """With MLA layers the cache slots hold the latent cache the program allocates (c [L, B, 1,
    S_max, r] in k_cache, k_rope [.., dr] in v_cache; layers/mla.py), not [.., Hkv, S_max, D]."""
    from megakernel.executor import executor_gpu
    from megakernel.program.compiler import compile_program

    cfg = preset("kimi-linear-tiny")
    spec = make_spec(cfg, 2, 1, "sm_90a").to_dict()
    buf = compile_program(cfg, 2, executor_gpu(8), max_seq_len=32).buffers
    ts = tensors(spec)
    ts["k_cache"] = torch.zeros(buf.kv_shape, dtype=torch.bfloat16)
    ts["v_cache"] = torch.zeros(buf.v_shape, dtype=torch.bfloat16)
    assert buf.kv_shape == (1, 2, 1, 32, 32) and buf.v_shape == (1, 2, 1, 32, 8)
    validate_args(spec, ts, lengths_off=128, require_cuda=False)
    swapped = {**ts, "k_cache": ts["v_cache"], "v_cache": ts["k_cache"]}
    with pytest.raises(ArgumentError, match=r"k_cache must be \[L, B, Hkv, S_max, D\] = \[1, 2, "
                                            r"1, S_max, 32\]"):
        validate_args(spec, swapped, lengths_off=128, require_cuda=False)
    shorter = {**ts, "v_cache": torch.zeros(1, 2, 1, 16, 8, dtype=torch.bfloat16)}
    with pytest.raises(ArgumentError, match="differ"):
        validate_args(spec, shorter, lengths_off=128, require_cuda=False)


def test_check_records_accepts_the_mla_layers_records_and_refuses_a_wrong_head():
    """The MLA layer's records of a kimi-linear-tiny program (its projection, o_proj and the
    three latent-attention opcodes) fit an MLA build; a head past H is refused."""
    from megakernel.executor import executor_gpu
    from megakernel.program.compiler import compile_program

    cfg = preset("kimi-linear-tiny")
    spec = make_spec(cfg, 2, 1, "sm_90a").to_dict()
    prog = compile_program(cfg, 2, executor_gpu(8), max_seq_len=32)
    layer = next(b.layer for b in cfg.blocks if b.kind == "mla")
    ops = {isa.Op.PROJ, isa.Op.MLA_Q, isa.Op.MLA, isa.Op.MLA_O, isa.Op.OPROJ}
    kept = [r for q in prog.records().tolist() for r in q
            if r[0] in ops and isa.decode(r)["LAYER"] == layer]
    assert {r[0] for r in kept} == ops
    recs = torch.tensor([[*kept, [0] * isa.RECORD_WORDS]], dtype=torch.int32)
    check_records(recs, spec)
    head = next(i for i, r in enumerate(kept) if r[0] == isa.Op.MLA_O)
    recs[0, head, isa.field_index(isa.Op.MLA_O, "HEAD")] = cfg.kind_config("mla").num_heads
    with pytest.raises(ArgumentError, match="head 4 outside the build's H=4"):
        check_records(recs, spec)
