"""The Qwen3.5 vision tower and the image path of the text model against transformers (CPU, fp32).

The reference is transformers' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration
on tiny configs. Its image processor needs torchvision, which is not installed here, so the
inputs are built as the processor lays them out: random patch values [patches, C * Tp * P * P]
and each image's (t, h, w) grid; the image tokens' count per image is t * h * w / merge^2.
Grids differ from the learned 4 x 4 position grid both ways (resampled up and down), and one
image has two frames (attention per frame, t positions that move).
"""

import pytest
import torch
import transformers
from primerl_models import PackedSeqs, load_model, read_config, save_hf, to_hf, to_ours
from primerl_models.blocks.vision import mrope_positions
from primerl_models.families import FAMILIES
from primerl_models.testing import save_with_mtp, vlm_draw
from safetensors.torch import load_file

VOCAB, IMAGE = 96, 90  # the image token inside the tiny vocabulary
MERGE = 2
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    head_dim=16,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
)
DENSE = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    # full rotary (8 frequencies) and a section that leaves the last one to t alone
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        mrope_section=[4, 2, 2],
        mrope_interleaved=True,
    ),
)
MOE = dict(
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)  # default section
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=MERGE,
    num_position_embeddings=16,
)
PATCH = 3 * 2 * 2 * 2  # channels x frames x pixels


def vlm_checkpoint(folder, moe: bool):
    """A tiny released-layout Qwen3.5(-MoE) VLM saved by transformers (with MTP tensors beside
    it, as the released checkpoints have them); returns transformers' model."""
    text_cls, vlm_cls = (
        (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeConfig)
        if moe
        else (transformers.Qwen3_5TextConfig, transformers.Qwen3_5Config)
    )
    config = vlm_cls(
        text_config=text_cls(**TEXT, **(MOE if moe else DENSE)), vision_config=VISION, image_token_id=IMAGE
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        vlm_draw(hf)
    save_with_mtp(hf, folder)
    return hf


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3_5", "qwen3_5_moe"])
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe" if request.param else "dense")
    hf = vlm_checkpoint(folder, request.param)
    return hf, load_model(folder).eval(), folder


def document(pieces, seed):
    """input_ids [1, T], pixel_values and grids of a document: ints are runs of text tokens,
    (t, h, w) tuples images (their image tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids, pixels, grids = [], [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(torch.randint(0, IMAGE, (piece,), generator=g))
        else:
            t, h, w = piece
            ids.append(torch.full((t * h * w // MERGE**2,), IMAGE))
            pixels.append(torch.randn(t * h * w, PATCH, generator=g))
            grids.append(piece)
    return torch.cat(ids)[None], torch.cat(pixels) if pixels else None, torch.tensor(grids) if grids else None


def transformers_logits(hf, ids, pixels, grid):
    with torch.no_grad():
        return hf(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int()
        ).logits


def ours_logits(model, ids, pixels, grid, position_ids=None):
    position_ids = torch.arange(ids.shape[1])[None] if position_ids is None else position_ids
    with torch.no_grad():
        return model.logits(ids, position_ids, pixel_values=pixels, image_grid_thw=grid)


ONE = [5, (1, 4, 4), 7]
SEVERAL = [3, (1, 4, 4), 4, (1, 2, 6), 2, (1, 6, 4), 5, (2, 4, 2), 3]  # up, down, other aspect, two frames


@pytest.mark.parametrize("pieces", [ONE, SEVERAL], ids=["one-image", "several-images"])
def test_logits_with_images_match_transformers(models, pieces):
    hf, ours, _ = models
    ids, pixels, grid = document(pieces, seed=1)
    expected = transformers_logits(hf, ids, pixels, grid)
    got = ours_logits(ours, ids, pixels, grid)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # Both the images and their (t, h, w) positions showed: other pixels, or the text's 1-D
    # positions with these images, give other logits.
    other = ours_logits(ours, ids, torch.randn_like(pixels), grid)
    assert (other - expected).abs().max() > 1e-2
    with torch.no_grad():
        flat = ours.logits(
            ids,
            torch.arange(ids.shape[1])[None],
            pixel_values=pixels,
            image_grid_thw=grid,
            mrope_positions=torch.arange(ids.shape[1]).expand(3, 1, -1),
        )
    assert (flat - expected).abs().max() > 1e-3


def test_each_document_of_a_packed_row_with_its_images_matches_transformers_alone(models):
    hf, ours, _ = models
    docs = [
        document([4, (1, 4, 4), 6], seed=2),
        document([(1, 2, 4), 3, (1, 6, 2), 5], seed=3),
    ]  # the second starts with an image
    ids = torch.cat([d[0] for d in docs], dim=1)
    pixels, grid = torch.cat([d[1] for d in docs]), torch.cat([d[2] for d in docs])
    position_ids = torch.cat([torch.arange(d[0].shape[1]) for d in docs])[None]
    expected = torch.cat([transformers_logits(hf, *d) for d in docs], dim=1)
    torch.testing.assert_close(ours_logits(ours, ids, pixels, grid, position_ids), expected, atol=1e-4, rtol=0)


def test_vision_tower_equals_transformers_image_features(models):
    hf, ours, _ = models
    _, pixels, grid = document(SEVERAL, seed=4)
    with torch.no_grad():
        expected = torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)
        got = ours.visual(pixels, grid)
    assert got.shape == (int(grid.prod(-1).sum()) // MERGE**2, TEXT["hidden_size"]) and expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_mrope_positions_equal_transformers_rope_index(models):
    hf, ours, _ = models
    rows = [document([3, (1, 4, 4), 2, (1, 2, 6), 4], seed=5), document([(2, 4, 2), 6, (1, 6, 4)], seed=6)]
    ids = torch.cat([r[0] for r in rows])
    grid = torch.cat([r[2] for r in rows])
    expected, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grid)
    seqs = PackedSeqs.from_position_ids(torch.arange(ids.shape[1]).expand(2, -1))
    assert torch.equal(mrope_positions(ids, seqs, grid, ours.args.vision), expected)
    # A packed row: each document's positions are its own.
    packed = torch.cat([ids[0], ids[1]])[None]
    seqs = PackedSeqs.from_position_ids(torch.cat([torch.arange(ids.shape[1])] * 2)[None])
    got = mrope_positions(packed, seqs, grid, ours.args.vision)
    assert torch.equal(got, torch.cat([expected[:, 0], expected[:, 1]], dim=1)[:, None])


def test_text_alone_is_the_text_path_exactly(models):
    hf, ours, _ = models
    ids, _, _ = document([20], seed=7)
    pos = torch.arange(20)[None]
    with torch.no_grad():
        plain = ours.logits(ids, pos)
        three = ours.logits(ids, pos, mrope_positions=pos.expand(3, 1, -1))
        expected = hf(input_ids=ids).logits
    assert torch.equal(plain, three)
    torch.testing.assert_close(plain, expected, atol=1e-4, rtol=0)


def test_checkpoint_round_trip_is_exact_with_the_tower(models, tmp_path):
    _, ours, src = models
    cfg = read_config(src)
    state = ours.state_dict()
    assert any(n.startswith("visual.") for n in state) and not any(n.startswith("mtp.") for n in state)
    back = to_ours(to_hf(state, ours.args), ours.args)
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], state[n]) for n in state)
    from primerl_models import carried_tensors

    save_hf(state, cfg, tmp_path, max_shard_bytes=40_000, carried=carried_tensors(src, cfg, torch.float32))
    before, after = ({k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()} for d in (src, tmp_path))
    assert sorted(before) == sorted(after) and any(n.startswith("model.visual.") for n in after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    assert ours.args.vision.num_params() == sum(p.numel() for p in ours.visual.parameters())


def test_tower_is_frozen_by_default_and_trains_when_asked(models):
    _, frozen, folder = models
    assert not any(p.requires_grad for p in frozen.visual.parameters())
    assert all(p.requires_grad for n, p in frozen.named_parameters() if not n.startswith("visual."))
    ids, pixels, grid = document(ONE, seed=8)
    trainable = load_model(folder, freeze_vision=False)
    for model, tower_grads in ((frozen, False), (trainable, True)):
        model.zero_grad()
        model.logits(ids, torch.arange(ids.shape[1])[None], pixel_values=pixels, image_grid_thw=grid).sum().backward()
        assert all((p.grad is not None) == tower_grads for p in model.visual.parameters())
        assert model.embed_tokens.weight.grad is not None


def test_malformed_images_are_refused_naming_what_is_wrong(models):
    _, ours, _ = models
    ids, pixels, grid = document(ONE, seed=9)
    pos = torch.arange(ids.shape[1])[None]
    cases = [
        (dict(pixel_values=pixels[:-4], image_grid_thw=grid), "image_grid_thw accounts for 16 patches"),
        (dict(pixel_values=pixels[:, :-1], image_grid_thw=grid), "expected \\[patches, 24\\]"),
        (
            dict(pixel_values=torch.cat([pixels, pixels]), image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]])),
            "4 image tokens \\(id 90\\), but the images give 8 features",
        ),
        (dict(pixel_values=pixels, image_grid_thw=torch.tensor([1, 4, 4])), "must be integers \\[images, 3\\]"),
        (dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 3, 4]])), "multiples of the merge size 2"),
        (dict(pixel_values=pixels), "pixel_values and image_grid_thw come together"),
        (dict(pixel_values=pixels, image_grid_thw=grid, mrope_positions=pos), "mrope_positions has shape"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ours(ids, pos, **kwargs)
    # one image token too many (the text says 5 tokens, the image gives 4)
    extra = torch.cat([ids, torch.tensor([[IMAGE]])], dim=1)
    with pytest.raises(ValueError, match="5 image tokens \\(id 90\\), but the images give 4 features"):
        ours(extra, torch.arange(extra.shape[1])[None], pixel_values=pixels, image_grid_thw=grid)


def test_text_model_without_a_tower_refuses_images():
    family = FAMILIES["qwen3_5_text"]
    args = family.args_from_hf(transformers.Qwen3_5TextConfig(**TEXT, **DENSE).to_dict())
    from primerl_models import build_model

    model = build_model(args)
    ids, pixels, grid = document(ONE, seed=10)
    with pytest.raises(ValueError, match="no vision tower"):
        model(ids, torch.arange(ids.shape[1])[None], pixel_values=pixels, image_grid_thw=grid)
