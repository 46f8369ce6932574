"""RoPE scaling kinds against transformers at positions past the original context, from both spellings real
config files use (`rope_parameters`, and `rope_theta` + `rope_scaling` with `type` or `rope_type`)."""

from __future__ import annotations

import json

import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.rope import parse_rope
from moe import MoEModel
from tests.checkpoints import hf_model, tiny_config, write_checkpoint

pytestmark = pytest.mark.reference

ORIGINAL = 16  # the pre-training context of these tiny models: every test goes past it
SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=32, beta_slow=1),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, mscale=0.707,
                        mscale_all_dim=1.0, truncate=False),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                     short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.0 + 0.5 * i for i in range(8)]),
}


def hub_spelling(params: dict, theta: float, key: str) -> dict:
    """`rope_theta` beside `rope_scaling`, the scaling's kind under `key` ("type" or "rope_type")."""
    scaling = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    return {"rope_theta": theta, "rope_scaling": {key: params["rope_type"], **scaling}}


@pytest.mark.parametrize("spelling", ["rope_parameters", "type", "rope_type"])
@pytest.mark.parametrize("kind", SCALINGS)
def test_scaled_rope_matches_transformers_past_the_original_context(kind, spelling, tmp_path):
    params = SCALINGS[kind] | {"rope_theta": 10000.0}
    max_position = ORIGINAL if kind == "dynamic" else 4 * ORIGINAL  # dynamic: the config's length is the original
    hf = hf_model("mixtral", rope_parameters=dict(params), max_position_embeddings=max_position, head_dim=16)
    hf.save_pretrained(tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(config_path.read_text())
    if spelling != "rope_parameters":
        cfg.pop("rope_parameters", None)
        cfg |= hub_spelling(params, 10000.0, spelling)
    config_path.write_text(json.dumps(cfg))
    model = MoEModel.from_pretrained(tmp_path / "hf")
    assert model.config.rope_scaling.kind == params["rope_type"]
    ids = torch.randint(3, 128, (1, 3 * ORIGINAL), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids).logits
    assert (model(ids) - want).abs().max().item() < 1e-4
    # Decoding from a prompt inside the original context out past it, step by step (dynamic and longrope change
    # their angles with each step's length), teacher-forced on a fresh transformers model's greedy tokens.
    hf = hf_model("mixtral", rope_parameters=dict(params), max_position_embeddings=max_position, head_dim=16)
    prompt, steps = ids[:, :ORIGINAL - 4], 2 * ORIGINAL
    with torch.no_grad():
        forced = hf.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    engine, P = model.engine, prompt.shape[1]
    engine.start(1, P + steps, torch.zeros(1, dtype=torch.long))
    logits = engine.forward_last(prompt, 0)
    for step in range(steps):
        assert (logits - forced.logits[step]).abs().max().item() < 1e-4, step
        logits = engine.forward_last(forced.sequences[:, P + step, None], P + step)


def test_an_unknown_rope_kind_is_refused_in_one_line():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=96, vocab_size=128)
    with pytest.raises(ConfigError, match="rope_type='wavelet'; supported: default, linear, dynamic, yarn, llama3, "
                                          "longrope"):
        ModelConfig.from_hf(base | {"rope_scaling": {"type": "wavelet", "factor": 2.0}})
    with pytest.raises(ConfigError, match="rope_type 'llama3' needs the field 'low_freq_factor'"):
        ModelConfig.from_hf(base | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}})


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "yarn"])
def test_the_static_shape_decode_step_takes_the_same_angles(kind, tmp_path):
    """A compiled step's form (the slot a tensor on the device, `decode_step`) computes the length-dependent angles
    from that tensor: the logits of the growing form, across the original context's end."""
    theta, scaling = parse_rope({"rope_parameters": SCALINGS[kind] | {"rope_theta": 1e4},
                                 "max_position_embeddings": 4 * ORIGINAL})
    cfg = tiny_config(rope_theta=theta, rope_scaling=scaling, max_seq_len=4 * ORIGINAL,
                      max_position_embeddings=ORIGINAL if kind == "dynamic" else None)
    net = MoEModel.from_pretrained(write_checkpoint(tmp_path / "ckpt", cfg)).engine.model
    tokens = torch.randint(3, 128, (1, ORIGINAL - 3), generator=torch.Generator().manual_seed(1))
    growing, static = net.make_caches(1, 3 * ORIGINAL), net.make_caches(1, 3 * ORIGINAL)
    nxt = torch.tensor([[11]])
    with torch.inference_mode():
        net(tokens, 0, growing)
        net(tokens, 0, static)
        for slot in range(ORIGINAL - 3, ORIGINAL + 8):
            want = net(nxt, slot, growing, None, last_only=True)[:, -1]
            got = net.decode_step(nxt, torch.tensor([slot]), static, None)
            assert (got - want).abs().max().item() < 1e-5, slot
            nxt = want.argmax(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_angles_are_each_sequences_own_in_a_batch(kind, tmp_path):
    """A short prompt batched with a long one (left-padded) gets the logits it gets alone, at the prompt and at each
    step across the original context's end: its angles follow its own length, not the batch's longest."""
    theta, scaling = parse_rope({"rope_parameters": SCALINGS[kind] | {"rope_theta": 1e4},
                                 "max_position_embeddings": 4 * ORIGINAL})
    cfg = tiny_config(rope_theta=theta, rope_scaling=scaling, max_seq_len=4 * ORIGINAL,
                      max_position_embeddings=ORIGINAL if kind == "dynamic" else None)
    engine = MoEModel.from_pretrained(write_checkpoint(tmp_path / "ckpt", cfg)).engine
    short, long = (torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n))
                   for n in (ORIGINAL - 6, ORIGINAL + 2))
    steps, pad = 10, long.numel() - short.numel()

    def run(tokens: torch.Tensor, pads: list[int]) -> list[torch.Tensor]:
        engine.start(len(pads), tokens.shape[1] + steps, torch.tensor(pads))
        out = [engine.forward_last(tokens, 0)]
        for step in range(steps):
            out.append(engine.forward_last(torch.full((len(pads), 1), 5 + step), tokens.shape[1] + step))
        return out

    with torch.inference_mode():
        batched = run(torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), short]), long]), [pad, 0])
        alone = run(short[None], [0])
    for step, (b, a) in enumerate(zip(batched, alone, strict=True)):
        assert (b[0] - a[0]).abs().max().item() < 1e-5, step
