"""Tensor names both ways: ``Entry`` (one of our parameters <-> one Hugging Face tensor), and the rows most families
share.

Each family lists its ``ENTRIES`` in the order the export writes them (per layer), built from the groups here and its
own rows; ``interop/hf.py`` keeps those of a model's family whose condition (``when``) the model meets. Our layers are
stacked on a leading axis (the scanned block), HF's are numbered (``{i}``); ``"NH,D"`` names a ``[N*H, D]`` matrix. An
HF letter that our parameter lacks must have size 1 (``O``: the convolution's ``[C, 1, K]``). A hybrid's attention
rows are held by its attention layers, its delta-net rows (``blocks.delta.``) by its linear layers: each stacked over
those layers alone (``Entry.layers``: the layer of each row).

One HF tensor may hold several of our parameters (``Fused``): Qwen3.5's ``in_proj_qkv`` (q, k and v rows one after
the other), Qwen3-Next's ``in_proj_qkvz`` (per key head: its q, k, then its value heads' v and z rows). Each of those
parameters is an ``Entry`` of one piece, its ``hf_dims`` the piece's own (the groups first); import cuts the piece out
of the tensor, export writes the tensor once all its pieces are there. Pure NumPy: nothing of the model is imported.
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
    "shared_expert": lambda cfg: bool(cfg.shared_expert_dim),  # the sparse layers' shared expert (Qwen3-Next)
}


@dataclasses.dataclass(frozen=True)
class Fused:
    """An HF tensor of several pieces: its first dimension is ``groups`` (letters; ``""``: one group) of ``pieces``
    (letter products, in order); the entry is piece ``index``, in every group."""

    groups: str
    pieces: tuple[str, ...]
    index: int

    def rows(self, sizes: dict[str, int]) -> tuple[int, int, int, int]:
        """``(groups, rows per group, this piece's first row in a group, its rows)``."""
        widths = [math.prod(sizes[c] for c in p) for p in self.pieces]
        return (math.prod(sizes[c] for c in self.groups), sum(widths), sum(widths[:self.index]), widths[self.index])


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor both ways. ``dims``: our letters (per layer); ``hf_dims``: HF letters, ``,`` between dimensions."""

    param: str
    dims: str
    hf: str  # ``{i}``: the layer number, for parameters of the stacked block
    hf_dims: str
    when: str | None = None  # what must hold (a key of CONDITIONS)
    fused: Fused | None = None  # one piece of an HF tensor that other entries share

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
        """The layers that hold this (stacked) tensor, one per row of our parameter (``ModelConfig.stacked_layers``):
        a hybrid's attention and delta-net each over their own layers, a mixed MoE's experts over the sparse layers
        and its dense MLP over the dense ones, anything else over every layer."""
        return list(cfg.stacked_layers(self.param.split(".")[1]))

    def hf_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape of this entry's tensor (of its piece, for a fused one)."""
        return tuple(math.prod(sizes[c] for c in g) for g in self.hf_dims.split(","))

    def tensor_shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The shape of the whole HF tensor (several pieces' for a fused entry)."""
        shape = self.hf_shape(sizes)
        if self.fused is None:
            return shape
        groups, per_group, _, _ = self.fused.rows(sizes)
        return (groups * per_group, *shape[1:])

    def piece(self, x: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        """This entry's piece of the whole HF tensor ``x`` (``x`` itself when not fused)."""
        if self.fused is None:
            return x
        groups, per_group, first, rows = self.fused.rows(sizes)
        return x.reshape(groups, per_group, *x.shape[1:])[:, first:first + rows].reshape(self.hf_shape(sizes))

    def to_ours(self, x: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        """An HF tensor (or a block of it whose single-letter dimensions are cut) -> our layout."""
        shape = []
        for group, n in zip(self.hf_dims.split(","), x.shape):
            shape += [n] if len(group) == 1 else [sizes[c] for c in group]  # merged dims are never cut
        flat = self.hf_dims.replace(",", "")
        x = x.reshape(shape)
        x = x[tuple(slice(None) if c in self.dims else 0 for c in flat)]  # HF's letters of size 1 that we lack
        kept = [c for c in flat if c in self.dims]
        return x.transpose([kept.index(c) for c in self.dims])

    def to_hf(self, x: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        flat = [c for c in self.hf_dims.replace(",", "") if c in self.dims]
        return x.transpose([self.dims.index(c) for c in flat]).reshape(self.hf_shape(sizes))


def assemble(pieces: list[tuple[Entry, np.ndarray]], sizes: dict[str, int]) -> np.ndarray:
    """The whole HF tensor from its fused entries' pieces (each in HF layout, ``Entry.to_hf``), in piece order."""
    pieces = sorted(pieces, key=lambda p: p[0].fused.index)
    groups = pieces[0][0].fused.rows(sizes)[0]
    blocks = [x.reshape(groups, -1, *x.shape[1:]) for _, x in pieces]
    whole = np.concatenate(blocks, axis=1)
    return whole.reshape(-1, *whole.shape[2:])


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
