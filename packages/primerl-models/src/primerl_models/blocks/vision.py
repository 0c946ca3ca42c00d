"""The vision tower of a vision-language model (Qwen3.5; Qwen3-VL without deepstack): pixels
to text-model tokens, and where those tokens go in the text.

    features_ME = model.visual(pixel_values_NP, image_grid_thw_I3)      # image after image
    x_BTD = scatter_images(x_BTD, input_ids_BT, features_ME, spec)      # at the image tokens
    positions_3BT = mrope_positions(input_ids_BT, seqs, image_grid_thw_I3, spec)

Same math as transformers 5.19's modeling_qwen3_5 (the parity tests' reference), written for
our packed rows: the tower sees every image of a batch at once, attention restricted to each
frame; the (t, h, w) positions restart at each document.

The inputs are what the Qwen image processor makes (images resized to multiples of
patch_size x merge, normalised, each repeated to temporal_patch_size frames):
  pixel_values [N, C * Tp * P * P]: one row per patch (channel, frame, row, column within it),
    each image's patches in merge-block order: row of blocks, column of blocks, then the m x m
    patches of a block row by row, so that m^2 consecutive patches merge into one token;
  image_grid_thw [I, 3]: each image's frames / Tp, rows and columns of patches (rows and
    columns multiples of the merge size m).
Image i becomes t * h * w / m^2 tokens, which replace that many image tokens of the text, in
order.

Legend: N patches, P values per patch, D vision width, H heads, K head_dim, I images,
F frames (attention units), M merged tokens (N / m^2), E text width, B batch, T tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from primerl_models.args import Vision
from primerl_models.blocks.attention import _varlen_fn
from primerl_models.blocks.rope import apply_rope
from primerl_models.packing import PackedSeqs


@dataclass
class ImageLayout:
    """Where each patch of a batch of images sits, computed once per forward (host side: the
    grid sizes decide tensor shapes)."""

    grids: list[tuple[int, int, int]]
    rows_N: torch.Tensor
    """int64 [N]: each patch's row in its image, in merge-block order (frames repeat it)."""
    cols_N: torch.Tensor
    cu_frames: torch.Tensor
    """int32 [F + 1]: frame boundaries; attention stays inside a frame."""
    max_frame: int

    @classmethod
    def build(cls, grid_thw_I3: torch.Tensor, merge: int, device: torch.device) -> ImageLayout:
        grids = [tuple(g) for g in grid_thw_I3.tolist()]
        rows, cols, frames = [], [], []
        for t, h, w in grids:
            r, c = block_order(h, w, merge, device)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
            frames += [h * w] * t
        cu = torch.tensor([0, *frames], device=device).cumsum(0).to(torch.int32)
        return cls(grids, torch.cat(rows), torch.cat(cols), cu, max(frames))


def block_order(h: int, w: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [h * w] rows and columns of an h x w patch grid in merge-block order."""
    shape = (h // merge, w // merge, merge, merge)  # block row, block column, row in block, column in block
    within = torch.arange(merge, device=device)
    rows = torch.arange(h // merge, device=device)[:, None, None, None] * merge + within[:, None]
    cols = torch.arange(w // merge, device=device)[None, :, None, None] * merge + within
    return rows.expand(shape).flatten(), cols.expand(shape).flatten()


def check_images(pixel_values_NP: torch.Tensor, grid_thw_I3: torch.Tensor, spec: Vision) -> None:
    """ValueError naming what does not fit: the patches' width, the grid's shape, an image's
    grid, or patches that the grids do not account for."""
    if pixel_values_NP.dim() != 2 or pixel_values_NP.shape[1] != spec.patch_dim:
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values_NP.shape)}, expected [patches, {spec.patch_dim}] "
            f"(channels {spec.in_channels} x frames {spec.temporal_patch_size} x {spec.patch_size}^2 pixels)"
        )
    if grid_thw_I3.dim() != 2 or grid_thw_I3.shape[1] != 3 or grid_thw_I3.is_floating_point():
        raise ValueError(
            f"image_grid_thw must be integers [images, 3] (t, h, w), got {tuple(grid_thw_I3.shape)} {grid_thw_I3.dtype}"
        )
    m = spec.spatial_merge_size
    for i, (t, h, w) in enumerate(grid_thw_I3.tolist()):
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(
                f"image_grid_thw[{i}] = {[t, h, w]}: t must be >= 1, h and w positive multiples of the merge size {m}"
            )
    patches = int((grid_thw_I3[:, 0] * grid_thw_I3[:, 1] * grid_thw_I3[:, 2]).sum())
    if patches != pixel_values_NP.shape[0]:
        raise ValueError(
            f"image_grid_thw accounts for {patches} patches (t * h * w summed over "
            f"{len(grid_thw_I3)} images), but pixel_values has {pixel_values_NP.shape[0]} rows"
        )


def frame_attention(q_NHK, k_NHK, v_NHK, layout: ImageLayout) -> torch.Tensor:
    """Bidirectional attention within each frame: flash varlen on CUDA in half precision;
    elsewhere SDPA over the frames right-padded to the longest, the padded keys masked out.
    Returns [N, H, K]."""
    cu, longest = layout.cu_frames, layout.max_frame
    varlen = _varlen_fn() if q_NHK.is_cuda and q_NHK.dtype in (torch.bfloat16, torch.float16) else None
    if varlen is not None:  # its default window (-1, -1) is the whole frame
        return varlen(q_NHK, k_NHK, v_NHK, cu, cu, longest, longest)
    n, h, k = q_NHK.shape
    if len(cu) == 2:  # one frame
        q, kk, v = (x.transpose(0, 1)[None] for x in (q_NHK, k_NHK, v_NHK))
        return F.scaled_dot_product_attention(q, kk, v)[0].transpose(0, 1)
    lengths = (cu[1:] - cu[:-1]).long()
    frame_N = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    at_N = frame_N * longest + (torch.arange(n, device=cu.device) - cu[frame_N].long())

    def pad(x_NHK):  # -> [F, H, longest, K]
        padded = x_NHK.new_zeros(len(lengths) * longest, h, k).index_copy(0, at_N, x_NHK)
        return padded.view(len(lengths), longest, h, k).transpose(1, 2)

    keys_F11L = (torch.arange(longest, device=cu.device) < lengths[:, None])[:, None, None, :]
    out_FHLK = F.scaled_dot_product_attention(pad(q_NHK), pad(k_NHK), pad(v_NHK), attn_mask=keys_F11L)
    return out_FHLK.transpose(1, 2).reshape(-1, h, k).index_select(0, at_N)


class PatchEmbed(nn.Module):
    """One patch's values -> D. HF stores it as a Conv3d whose kernel is its stride (one patch),
    which is a matrix product: computed as one, with the Conv3d's weight [D, C, Tp, P, P]."""

    def __init__(self, spec: Vision):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, pixels_NP: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels_NP.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, spec: Vision):
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x_ND, cos_NK, sin_NK, layout: ImageLayout) -> torch.Tensor:
        n = x_ND.shape[0]
        q_NHK, k_NHK, v_NHK = self.qkv(x_ND).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q_NHK = apply_rope(q_NHK[None], cos_NK[None], sin_NK[None])[0]
        k_NHK = apply_rope(k_NHK[None], cos_NK[None], sin_NK[None])[0]
        return self.proj(frame_attention(q_NHK, k_NHK, v_NHK, layout).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, spec: Vision):
        super().__init__()
        self.approximate = "tanh" if spec.activation == "gelu_tanh" else "none"
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x_ND), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-LayerNorm attention and MLP, each added to the residual stream."""

    def __init__(self, spec: Vision):
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.attn = VisionAttention(spec)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x_ND, cos_NK, sin_NK, layout: ImageLayout) -> torch.Tensor:
        x_ND = x_ND + self.attn(self.norm1(x_ND), cos_NK, sin_NK, layout)
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nn.Module):
    """Each m x m block of patches -> one text token: LayerNorm per patch, the block's m^2
    patches side by side, linear, exact GELU, linear to the text width."""

    def __init__(self, spec: Vision):
        super().__init__()
        self.merged = spec.hidden_size * spec.spatial_merge_size**2
        self.norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = nn.Linear(self.merged, spec.out_hidden_size, bias=True)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x_MD = self.norm(x_ND).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x_MD)))


class VisionTower(nn.Module):
    """Patches -> merged tokens of the text model's width (module names as HF's `model.visual`)."""

    def __init__(self, spec: Vision):
        super().__init__()
        self.spec = spec
        self.side = round(spec.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)

    def forward(self, pixel_values_NP: torch.Tensor, image_grid_thw_I3: torch.Tensor) -> torch.Tensor:
        """[M, E]: the merged tokens of every image, image after image."""
        check_images(pixel_values_NP, image_grid_thw_I3, self.spec)
        layout = ImageLayout.build(image_grid_thw_I3, self.spec.spatial_merge_size, pixel_values_NP.device)
        x_ND = self.patch_embed(pixel_values_NP)
        x_ND = x_ND + self.grid_positions(layout).to(x_ND.dtype)
        cos_NK, sin_NK = self.rotary(layout)
        for block in self.blocks:
            x_ND = block(x_ND, cos_NK, sin_NK, layout)
        return self.merger(x_ND)

    def grid_positions(self, layout: ImageLayout) -> torch.Tensor:
        """[N, D] fp32: the learned side x side grid resampled to each image's h x w (bilinear,
        corners aligned: the grid's corners land on the image's corner patches), read at each
        patch in merge-block order, the same for every frame."""
        table_1DSS = self.pos_embed.weight.float().view(self.side, self.side, -1).permute(2, 0, 1)[None]
        resampled: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in layout.grids:
            if (h, w) not in resampled:
                grid_Dhw = F.interpolate(table_1DSS, size=(h, w), mode="bilinear", align_corners=True)[0]
                rows, cols = block_order(h, w, self.spec.spatial_merge_size, grid_Dhw.device)
                resampled[(h, w)] = grid_Dhw[:, rows, cols].T
            out.append(resampled[(h, w)].repeat(t, 1))
        return torch.cat(out)

    def rotary(self, layout: ImageLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, K] fp32 of the 2-D RoPE: K/4 frequencies turn with the patch's row, K/4
        with its column, and the two halves of each head (rotate-half) repeat them."""
        k = self.spec.head_dim
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, k // 2, 2, dtype=torch.float32) / (k // 2)))
        inv_freq = inv_freq.to(layout.rows_N.device)
        freqs_NK2 = torch.cat([layout.rows_N[:, None] * inv_freq, layout.cols_N[:, None] * inv_freq], dim=-1)
        emb_NK = torch.cat([freqs_NK2, freqs_NK2], dim=-1)
        return emb_NK.cos(), emb_NK.sin()


def scatter_images(x_BTD: torch.Tensor, input_ids_BT: torch.Tensor, features_ME: torch.Tensor, spec: Vision):
    """The token embeddings with the image tokens' replaced by the image features, in order."""
    mask_BT = input_ids_BT == spec.image_token_id
    count = int(mask_BT.sum())  # one host sync
    if count != features_ME.shape[0]:
        raise ValueError(
            f"input_ids hold {count} image tokens (id {spec.image_token_id}), but the images give "
            f"{features_ME.shape[0]} features (t * h * w / {spec.spatial_merge_size}^2 each, from image_grid_thw)"
        )
    return x_BTD.masked_scatter(mask_BT[..., None], features_ME.to(x_BTD.dtype))


def mrope_positions(
    input_ids_BT: torch.Tensor, seqs: PackedSeqs, image_grid_thw_I3: torch.Tensor, spec: Vision
) -> torch.Tensor:
    """int64 [3, B, T]: the (t, h, w) position of every token, as transformers' get_rope_index
    gives them, restarting at each document. A text token has t = h = w = p, p counting on from
    the token before; image i (t x h' x w' tokens, h' = h / m, w' = w / m) starting at p puts
    its token (a, b, c) at (p + a, p + b, p + c), and the text after it goes on from
    p + max(h', w'). Images are taken in order; each one's tokens must be one run within one
    document."""
    b, t = input_ids_BT.shape
    device = input_ids_BT.device
    grid = image_grid_thw_I3.to(device).long()
    m = spec.spatial_merge_size
    hm, wm = grid[:, 1] // m, grid[:, 2] // m
    tokens_I = grid[:, 0] * hm * wm
    slots_S = (input_ids_BT.flatten() == spec.image_token_id).nonzero().squeeze(1)  # image tokens, in order
    if len(slots_S) != int(tokens_I.sum()):
        raise ValueError(
            f"input_ids hold {len(slots_S)} image tokens (id {spec.image_token_id}), but "
            f"image_grid_thw gives {int(tokens_I.sum())} (t * h * w / {m}^2 each)"
        )
    doc_N = seqs.doc_ids_BT.flatten().long()
    cu = seqs.cu_seqlens.long()
    first_I = tokens_I.cumsum(0) - tokens_I
    start_I, last_I = slots_S[first_I], slots_S[first_I + tokens_I - 1]
    broken = ((last_I - start_I) != tokens_I - 1) | (doc_N[last_I] != doc_N[start_I])
    if broken.any():
        i = int(broken.nonzero()[0])
        raise ValueError(f"image {i}'s {int(tokens_I[i])} tokens are not one run of image tokens within one document")
    # After image i the positions go on from its start + max(h', w'), not + its token count.
    delta_N = torch.zeros(b * t, dtype=torch.long, device=device)
    delta_N[last_I] = torch.maximum(hm, wm) - tokens_I
    before_N = delta_N.cumsum(0) - delta_N  # the images that ended before each token
    index_N = torch.arange(b * t, device=device) - cu[doc_N]
    text_N = index_N + before_N - before_N[cu[doc_N]]  # restarted at each document
    positions_3N = text_N.expand(3, -1).clone()
    image_S = torch.repeat_interleave(torch.arange(len(grid), device=device), tokens_I)
    local_S = torch.arange(len(slots_S), device=device) - first_I[image_S]
    plane_S = (hm * wm)[image_S]
    axes_3S = torch.stack([local_S // plane_S, (local_S // wm[image_S]) % hm[image_S], local_S % wm[image_S]])
    positions_3N[:, slots_S] = text_N[start_I][image_S] + axes_3S
    return positions_3N.view(3, b, t)
