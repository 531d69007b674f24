"""Rotary positions of a packed micro-batch for the models whose positions are not a plain count: Qwen's
vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 with its vision tower) number a picture's tokens
in three dimensions (time, height, width: mrope) and the text after it from the picture's extent on.

Packed, each row keeps the 3D positions it has alone: the model's own `get_rope_index` runs on each row with that
row's grid sizes, and the rows' positions are concatenated. transformers' Qwen VL language models then take
`position_ids` [4, 1, total]: the first line plain text positions restarting at 0 on each row (the mask builders
and flash-attention's varlen path find the rows' boundaries there, as for a packed text model), the other three
the 3D positions (the text model's own packed-input convention, see Qwen2_5_VLTextModel.forward)."""

from __future__ import annotations

import torch
from torch import Tensor


def packed_positions(model, input_ids: Tensor, lengths, images) -> Tensor:
    """[4, 1, total] position ids of the packed sequence `input_ids` [1, total] of `model` (a Qwen VL model or a
    peft model around one): rows of `lengths` tokens one after the other, row i's images `images[i]`
    (rlkit.batch.Images or None; `images` None when no row has any). Line 0 counts each row's tokens from 0;
    lines 1-3 are the row's 3D positions as the model computes them for the row alone."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner, config = base.model, base.config
    image_token = getattr(config, "image_token_id", None)
    device = input_ids.device
    parts, offset = [], 0
    for i, n in enumerate(lengths):
        ids = input_ids[:, offset : offset + n]
        picture = images[i] if images is not None else None
        grid = picture.tensors.get("image_grid_thw") if picture is not None else None
        pos, _ = inner.get_rope_index(
            ids, mm_token_type_ids=(ids == image_token).int(),
            image_grid_thw=grid.to(device) if grid is not None else None,
        )  # fmt: skip
        parts.append(pos)
        offset += n
    text = torch.cat([torch.arange(n, device=device) for n in lengths])
    return torch.cat([text.view(1, 1, -1).to(parts[0].dtype), torch.cat(parts, -1)], 0)
