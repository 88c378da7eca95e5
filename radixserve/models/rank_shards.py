"""A recurrent layer's checkpoint tensors as one tensor-parallel rank keeps them: a fused
projection's or convolution's rows sliced part by part (a part may be every rank's whole), the
output projection by columns (its bias added by rank 0 alone), the per-head parameters and
norms by rows. A layer mixes in `RankShardedLoading` and says its fused parts."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TPGroup
from .layers import Linear

Part = tuple[int, bool]  # (rows, kept whole by every rank)


def rank_share(
    name: str,
    tensor: torch.Tensor,
    tp: TPGroup,
    fused: dict[str, list[Part]],
    by_columns: tuple[str, ...] = ("out_proj",),
    whole: tuple[str, ...] = (),
    dims: dict[str, int] | None = None,
):
    """This rank's part of the layer's tensor `name` (relative to the layer): `fused` ones part
    by part, the `by_columns` modules' weights by columns (their bias on rank 0), the `whole`
    modules' every rank's, those `dims` names along their dim, the rest by rows."""
    module, _, kind = name.rpartition(".")
    if dims and name in dims:
        return tp.shard(tensor, dims[name])
    parts = fused.get(module.partition(".")[0] or kind)
    if parts is not None:
        pieces = tensor.split([rows for rows, _ in parts])
        kept = [p if whole else tp.shard(p, 0) for p, (_, whole) in zip(pieces, parts)]
        return torch.cat(kept)
    if module in whole:
        return tensor
    if module in by_columns:
        if kind == "weight":
            return tp.shard(tensor, 1)
        return torch.zeros_like(tensor) if tp.rank else tensor
    return tp.shard(tensor, 0)


class RankShardedLoading:
    """`load_checkpoint` and `missing_tensors` for a layer (an nn.Module) whose tensors
    `fused_parts` describes; `loaded` names the tensors it has taken."""

    loaded: set[str]
    by_columns: tuple[str, ...] = ("out_proj",)  # inputs sharded: outputs summed over ranks
    kept_whole: tuple[str, ...] = ()  # modules every rank keeps whole
    shard_dims: dict[str, int] = {}  # parameters split along another dim than their first
    # checkpoint projections that are parts of one of ours: name -> (ours, part)
    fused_names: dict[str, tuple[str, int]] = {}

    def fused_parts(self) -> dict[str, list[Part]]:
        """The fused tensors' parts, by the module that holds them (`in_proj`, `conv1d`)."""
        raise NotImplementedError

    def load_checkpoint(self, name: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        tensor = rank_share(
            name, tensor, tp, self.fused_parts(), self.by_columns, self.kept_whole, self.shard_dims
        )
        module_name, _, kind = name.rpartition(".")
        module_name, part = self.fused_names.get(module_name, (module_name, None))
        module = self.get_submodule(module_name) if module_name else self
        if isinstance(module, Linear):
            module.load(kind, tensor, sum(module.parts[:part]) if part else 0)
            name = f"{module_name}.{kind}"
        else:
            target = getattr(module, kind, None)
            if not isinstance(target, torch.Tensor) or target.shape != tensor.shape:
                want = None if target is None else tuple(target.shape)
                raise ValueError(f"layer tensor {name!r}: this rank expects {want}")
            with torch.no_grad():
                target.copy_(tensor)
        self.loaded.add(name)

    def missing_tensors(self) -> list[str]:
        assert isinstance(self, nn.Module)
        expected = {n.replace(".weight_t", ".weight") for n, _ in self.named_parameters()}
        return sorted(expected - self.loaded)
