"""Tensor names both ways: ``Entry`` (one of our parameters <-> one Hugging Face tensor), and the rows most families
share.

Each family lists its ``ENTRIES`` in the order the export writes them (per layer), built from the groups here and its
own rows; ``interop/hf.py`` keeps those of a model's family whose condition (``when``) the model meets. Our layers are
stacked on a leading axis (the scanned block), HF's are numbered (``{i}``); ``"NH,D"`` names a ``[N*H, D]`` matrix.
Pure NumPy: nothing of the model is imported.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# what each ``when`` asks of a config: a row is kept when it holds
CONDITIONS = {
    None: lambda cfg: True,
    "untied": lambda cfg: not cfg.tie_embeddings,
    "qkv_bias": lambda cfg: cfg.qkv_bias,
    "qk_norm": lambda cfg: cfg.qk_norm,
    "o_bias": lambda cfg: cfg.o_bias,
    "attn_sinks": lambda cfg: cfg.attn_sinks,
    "dense": lambda cfg: cfg.has_dense_mlp,  # and the layers that have the tensor: those with a dense MLP
    "experts": lambda cfg: bool(cfg.num_experts),  # and the layers that have it: the sparse ones
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor both ways. ``dims``: our letters (per layer); ``hf_dims``: HF letters, ``,`` between dimensions."""

    param: str
    dims: str
    hf: str  # ``{i}``: the layer number, for parameters of the stacked block
    hf_dims: str
    when: str | None = None  # what must hold (a key of CONDITIONS)

    @property
    def stacked(self) -> bool:
        return self.param.startswith("blocks.")

    @property
    def experts(self) -> bool:
        """One HF tensor per expert (``{j}`` in the name), stacked on our ``E`` dimension (the router has an ``E``
        dimension too, in one tensor)."""
        return "{j}" in self.hf

    @property
    def per_tensor(self) -> Entry:
        """This entry for one HF tensor: without our ``E`` dimension for an experts' entry."""
        return dataclasses.replace(self, dims=self.dims.replace("E", "")) if self.experts else self

    def applies(self, cfg) -> bool:
        """Whether a model with ``cfg`` has this tensor (its ``when`` holds)."""
        return CONDITIONS[self.when](cfg)

    def layers(self, cfg) -> list[int]:
        """The layers that hold this (stacked) tensor: the sparse ones for experts, the dense ones for a dense MLP."""
        if self.when == "experts":
            return list(cfg.sparse_layers)
        if self.when == "dense":
            return [i for i in range(cfg.num_layers) if i not in cfg.sparse_layers]
        return list(range(cfg.num_layers))

    def hf_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(math.prod(sizes[c] for c in g) for g in self.hf_dims.split(","))

    def to_ours(self, x: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        """An HF tensor (or a block of it whose single-letter dimensions are cut) -> our layout."""
        shape = []
        for group, n in zip(self.hf_dims.split(","), x.shape):
            shape += [n] if len(group) == 1 else [sizes[c] for c in group]  # merged dims are never cut
        flat = self.hf_dims.replace(",", "")
        return x.reshape(shape).transpose([flat.index(c) for c in self.dims])

    def to_hf(self, x: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        flat = self.hf_dims.replace(",", "")
        return x.transpose([self.dims.index(c) for c in flat]).reshape(self.hf_shape(sizes))


LAYER = "model.layers.{i}."
# the embedding and the attention sublayer (its biases, q/k norms and sinks where the config has them)
ATTENTION: tuple[Entry, ...] = (
    Entry("embed_VD", "VD", "model.embed_tokens.weight", "V,D"),
    Entry("blocks.attn_norm.scale", "D", LAYER + "input_layernorm.weight", "D"),
    Entry("blocks.attn.wq_DNH", "DNH", LAYER + "self_attn.q_proj.weight", "NH,D"),
    Entry("blocks.attn.wk_DKH", "DKH", LAYER + "self_attn.k_proj.weight", "KH,D"),
    Entry("blocks.attn.wv_DKH", "DKH", LAYER + "self_attn.v_proj.weight", "KH,D"),
    Entry("blocks.attn.bq_NH", "NH", LAYER + "self_attn.q_proj.bias", "NH", "qkv_bias"),
    Entry("blocks.attn.bk_KH", "KH", LAYER + "self_attn.k_proj.bias", "KH", "qkv_bias"),
    Entry("blocks.attn.bv_KH", "KH", LAYER + "self_attn.v_proj.bias", "KH", "qkv_bias"),
    Entry("blocks.attn.q_norm.scale", "H", LAYER + "self_attn.q_norm.weight", "H", "qk_norm"),
    Entry("blocks.attn.k_norm.scale", "H", LAYER + "self_attn.k_norm.weight", "H", "qk_norm"),
    Entry("blocks.attn.wo_NHD", "NHD", LAYER + "self_attn.o_proj.weight", "D,NH"),
    Entry("blocks.attn.bo_D", "D", LAYER + "self_attn.o_proj.bias", "D", "o_bias"),
    Entry("blocks.attn.sinks_N", "N", LAYER + "self_attn.sinks", "N", "attn_sinks"),
)
# the Llama layout's norm before the MLP ("post_attention_layernorm": after the attention, before the MLP)
MLP_NORM = (Entry("blocks.mlp_norm.scale", "D", LAYER + "post_attention_layernorm.weight", "D"),)
# the gated MLP of the layers without experts
DENSE_MLP = (
    Entry("blocks.mlp.w_gate_DF", "DF", LAYER + "mlp.gate_proj.weight", "F,D", "dense"),
    Entry("blocks.mlp.w_up_DF", "DF", LAYER + "mlp.up_proj.weight", "F,D", "dense"),
    Entry("blocks.mlp.w_down_FD", "FD", LAYER + "mlp.down_proj.weight", "D,F", "dense"),
)
OUTPUT = (
    Entry("final_norm.scale", "D", "model.norm.weight", "D"),
    Entry("lm_head_VD", "VD", "lm_head.weight", "V,D", "untied"),
)


def llama_entries(mlp: tuple[Entry, ...] = DENSE_MLP) -> tuple[Entry, ...]:
    """The rows of the Llama layout with ``mlp`` (a family's experts, after the dense MLP where it has one)."""
    return (*ATTENTION, *MLP_NORM, *mlp, *OUTPUT)
