"""The plugin's model classes: vLLM's Llama, Qwen3 and Qwen2 whose decode steps (one token per
sequence) and speculative verify steps (1 + drafts per sequence, ngram drafting; vLLM's attention
metadata of the CPU backend) run on the megakernel's paged programs; prefill, mixed batches and
anything else run on vLLM's own model. vLLM still samples (and accepts drafts): `compute_logits`
returns the programs' fp32 logits for the rows `forward` served.

Nemotron-H (Mamba2 + attention + relu^2 MLP) is served its decode steps the same way, its Mamba2
layers' conv windows and states read from and written back to the state slots vLLM gives each
request (decode.StateSlots); its speculative steps and vLLM's own ReplaySSM stay on vLLM's
model."""

from __future__ import annotations

import logging

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from megakernel.common.errors import ConfigError
from megakernel.models import config_from_hf_dict
from megakernel.program.paged import PagedKV
from megakernel.vllm_plugin import ARCHITECTURES
from megakernel.vllm_plugin.decode import PagedDecoder, StateSlots
from megakernel.vllm_plugin.weights import hf_weights

log = logging.getLogger(__name__)
PAGE_ISA = "vec"  # the CPU attention kernel whose page layout program/paged.py follows
TOKEN_DRAFTERS = ("ngram", "ngram_gpu")  # spec methods whose verify steps the plugin serves


def verify_width(vllm_config) -> tuple[int, str | None]:  # noqa: ANN001
    """The most tokens a sequence brings to a step the plugin serves: 1 + k under an ngram
    speculative config (its verify steps), else 1; and why the plugin must not serve at all, if
    so (a drafter that reads the target model's hidden states, which the program does not
    return: EAGLE, MTP, Medusa, ...)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 1, None
    if spec.method in TOKEN_DRAFTERS:
        return 1 + spec.num_speculative_tokens, None
    if spec.use_eagle() or spec.method in ("medusa", "extract_hidden_states"):
        return 1, f"speculative method {spec.method!r} drafts from the target's hidden states"
    return 1, None  # a draft model's or suffix drafts: verify steps stay on vLLM's model


class MegakernelMixin:
    """Put before a vLLM model class: `forward` / `compute_logits` route decode and verify
    steps to the megakernel (module docstring). `megakernel_stats()`: decode steps served per
    bucket; `megakernel_verify_stats()`: verify steps served and their program runs."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:  # noqa: ANN001
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf = vllm_config.model_config.hf_config.to_dict()
        arch = next(a for a in hf.get("architectures") or () if a in ARCHITECTURES)
        hf = dict(hf, architectures=[ARCHITECTURES[arch]])
        self._mk: PagedDecoder | None = None
        self._mk_packed = None  # program/pack.PackedWeights, from load_weights
        self._mk_logits: torch.Tensor | None = None  # [n, V] of the last step it served
        self._mk_off: str | None = None  # why the megakernel path is off, once known
        self._mk_width, why = verify_width(vllm_config)  # most tokens per sequence served
        if why is not None:
            self._refuse(why)
        if self._state_layers():
            if vllm_config.speculative_config is not None:
                self._refuse("speculative decoding of a model with recurrent layers (vLLM keeps "
                             "1 + k states per request, the program commits every token)")
            if getattr(vllm_config.cache_config, "use_replayssm", False):
                self._refuse("vLLM's ReplaySSM state layout (the program keeps its own ring)")
        try:  # cfg.quant from the checkpoint's quantization_config (docs/FP8.md)
            self._mk_cfg = config_from_hf_dict(hf)
        except ConfigError as e:  # a quantization megakernel does not serve: vLLM's model does
            if hf.get("quantization_config") is None:
                raise
            self._mk_cfg = config_from_hf_dict({k: v for k, v in hf.items()
                                                if k != "quantization_config"})
            if self._mk_off is None:
                self._refuse(f"quantization_config: {e}")
        if (self._mk_off is None and self._mk_cfg.quant is None
                and vllm_config.quant_config is not None):
            self._refuse(f"vLLM quantizes the model ({vllm_config.quant_config.get_name()}) "
                         "but its checkpoint has no FP8 quantization_config")

    def _refuse(self, why: str) -> None:
        """Keep every step on vLLM's model, with one warning saying why."""
        self._mk_off = why
        log.warning("megakernel: decode steps stay on vLLM's model (%s)", why)

    def megakernel_stats(self) -> dict[int, int]:
        return dict(self._mk.stats) if self._mk is not None else {}

    def megakernel_verify_stats(self) -> tuple[int, dict[tuple[int, int], int]]:
        """Verify steps served, and their program runs per (bucket, tokens per sequence)."""
        if self._mk is None:
            return 0, {}
        return self._mk.verify_steps, dict(self._mk.verify_stats)

    def _attn_layers(self) -> list:
        """vLLM's attention layers, in layer order."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def _state_layers(self) -> dict[int, torch.nn.Module]:
        """Decoder layer index -> vLLM's recurrent mixer of that layer (none in a dense model)."""
        return {}

    def _state_views(self, mixer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A recurrent mixer's state slots by the program's state region names, each
        [num_slots, *the region's row shape] (decode.StateSlots)."""
        raise NotImplementedError

    def _state_slots(self, n: int) -> StateSlots | None:
        """The recurrent layers' slots of a decode step of n sequences (each layer's from the
        metadata of its KV cache group), or None for a dense model."""
        layers = self._state_layers()
        if not layers:
            return None
        meta = get_forward_context().attn_metadata
        index = {i: meta[m.prefix].state_indices_tensor_d[:n, 0].long()
                 for i, m in layers.items()}
        return StateSlots({i: self._state_views(m) for i, m in layers.items()}, index)

    def _decode_meta(self, input_ids, intermediate_tensors, inputs_embeds):  # noqa: ANN001, ANN202
        """vLLM's attention metadata when this forward is a step we serve: every sequence brings
        at most `_mk_width` tokens (one: a decode step; up to 1 + k: a verify step)."""
        if input_ids is None or inputs_embeds is not None or intermediate_tensors is not None:
            return None
        metas = get_forward_context().attn_metadata
        if not isinstance(metas, dict):
            return None
        meta = metas.get(self._attn_layers()[0].layer_name)
        if (meta is None or not 1 <= getattr(meta, "max_query_len", 0) <= self._mk_width
                or not meta.causal):
            return None
        n = meta.query_start_loc.numel() - 1
        for m in self._state_layers().values():  # every sequence a decode of its state
            state_meta = metas.get(m.prefix)
            if (state_meta is None or state_meta.num_prefills
                    or state_meta.num_decodes != n):
                return None
        return meta if self._mk_packed is not None and self._megakernel_on() else None

    def _megakernel_on(self) -> bool:
        if self._mk_off is None:
            layers = self._attn_layers()
            first = layers[0]
            if getattr(first, "isa", None) != PAGE_ISA:
                self._mk_off = f"attention ISA {getattr(first, 'isa', None)!r}, not {PAGE_ISA!r}"
            elif first.kv_cache.dtype != torch.bfloat16 or first.kv_cache.dim() != 4:
                self._mk_off = f"KV cache {first.kv_cache.dtype} {tuple(first.kv_cache.shape)}"
            elif {len(m.kv_cache) for m in self._state_layers().values()} - {2}:
                counts = sorted({len(m.kv_cache) for m in self._state_layers().values()})
                self._mk_off = f"{counts} state tensors per recurrent layer, not 2"
            else:
                self._mk_off = ""
            if self._mk_off:
                self._refuse(self._mk_off)
        return not self._mk_off

    def load_weights(self, weights) -> set[str]:  # noqa: ANN001
        """vLLM's loading, then our packing from its parameters, once: vLLM-CPU moves its
        linear weights into oneDNN handles after loading (process_weights_after_loading), and
        its FP8 methods transpose, requantize or prepack theirs there, so the parameters are
        read here, as loaded (weights.py). An FP8 model whose parameters do not fit its format
        stays on vLLM's model, with one warning."""
        from megakernel.program.pack import pack_weights

        loaded = super().load_weights(weights)
        if self._mk_off:
            return loaded
        mapper = getattr(self, "hf_to_vllm_mapper", None)
        if self._mk_cfg.quant is None:
            self._mk_packed = pack_weights(self._mk_cfg, hf_weights(self._mk_cfg, self, mapper))
            return loaded
        try:  # an FP8 layout the plugin does not read is refused, not an error
            self._mk_packed = pack_weights(self._mk_cfg, hf_weights(self._mk_cfg, self, mapper))
        except ValueError as e:
            self._refuse(f"FP8 weights ({self._mk_cfg.quant.describe()}): {e}")
        return loaded

    def _decoder(self, width: int) -> PagedDecoder:
        if self._mk is None:  # the page pool is known from the first decode step on
            cfg, cache = self._mk_cfg, self._attn_layers()[0].kv_cache
            bs = cache.shape[2]  # [num_blocks, Hkv, block_size, 2 D] (a hybrid's may be larger
            # than cache_config.block_size asks: vLLM pads attention pages to the state's)
            paged = PagedKV(cache.shape[0], bs, min(width, cfg.max_position_embeddings // bs))
            self._mk = PagedDecoder(cfg, self._mk_packed, paged)
        return self._mk

    def forward(self, input_ids, positions, intermediate_tensors=None,  # noqa: ANN001, ANN201
                inputs_embeds=None, **kwargs):
        meta = self._decode_meta(input_ids, intermediate_tensors, inputs_embeds)
        self._mk_logits = None
        if meta is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                   **kwargs)
        n, r = meta.num_actual_tokens, meta.query_start_loc.numel() - 1  # tokens, sequences
        dec = self._decoder(meta.block_table.shape[1])
        self._mk_logits = dec.step(input_ids[:n].long(), meta.seq_lens[:r].long(),
                                   meta.block_table[:r, : dec.paged.max_blocks].long(),
                                   meta.slot_mapping[:n].long(),
                                   [a.kv_cache for a in self._attn_layers()],
                                   meta.query_start_loc.diff().long(), self._state_slots(r))
        # the rows vLLM picks for sampling come back to compute_logits: carry their index
        hidden = torch.zeros(input_ids.shape[0], self._mk_cfg.hidden_size,
                             dtype=torch.float32)
        hidden[:, 0] = torch.arange(input_ids.shape[0], dtype=torch.float32)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self._mk_logits is None:
            return super().compute_logits(hidden_states)
        return self._mk_logits[hidden_states[:, 0].round().long()]


class MegakernelLlamaForCausalLM(MegakernelMixin, LlamaForCausalLM):
    pass


class MegakernelQwen3ForCausalLM(MegakernelMixin, Qwen3ForCausalLM):
    pass


class MegakernelQwen2ForCausalLM(MegakernelMixin, Qwen2ForCausalLM):
    pass


class MegakernelNemotronHForCausalLM(MegakernelMixin, NemotronHForCausalLM):
    def _attn_layers(self) -> list:
        return [layer.mixer.attn for layer in self.model.layers if hasattr(layer.mixer, "attn")]

    def _state_layers(self) -> dict[int, torch.nn.Module]:
        return {i: layer.mixer for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mixer, MambaMixer2)}

    def _state_views(self, mixer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """MambaMixer2's (conv_state, ssm_state): the conv window [slots, C, K-1] (vLLM's "SD"
        layout stores it [slots, K-1, C]: a transposed view), the state [slots, H, P, N]."""
        conv, ssm = mixer.kv_cache
        return {"conv": conv if is_conv_state_dim_first() else conv.transpose(-1, -2),
                "state": ssm}
