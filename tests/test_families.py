"""Each MoE family against transformers' own implementation of it, on random weights written by transformers
(tiny configs that switch every knob of the family on): logits within 1e-4 (fp32), the same greedy tokens, and
N ranks under each strategy give the 1-rank tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe import MoEModel
from tests.checkpoints import ROOT

pytestmark = pytest.mark.reference

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# head_dim != hidden/heads, top-k > 2, a dense layer among MoE ones (mlp_only_layers, decoder_sparse_step), and
# each family's own knobs
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=24, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                       norm_topk_prob=True)),
    "qwen3_moe-unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                    norm_topk_prob=False, attention_bias=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                       shared_expert_intermediate_size=56, norm_topk_prob=False, decoder_sparse_step=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=6, num_experts_per_tok=3, clip_qkv=0.9, norm_topk_prob=False)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(num_local_experts=6, num_experts_per_tok=3, embedding_multiplier=3.0, residual_multiplier=0.4,
                        attention_multiplier=0.09, logits_scaling=2.5, attention_bias=True)),
    # alternating windows (2 shorter than the prompts), sinks, yarn without truncation, a clamp the weights reach
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, num_local_experts=6, num_experts_per_tok=3, sliding_window=5, swiglu_limit=1.5,
                     swiglu_alpha=1.2, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                                            beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                            original_max_position_embeddings=32))),
    # latent attention with q's bottleneck, grouped sigmoid routing with its choosing bias, scaling, a shared
    # expert, a dense first block, yarn entering the softmax scale (mscale_all_dim)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                         first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1, moe_intermediate_size=32,
                         routed_scaling_factor=2.5, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                                         factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                                                                         original_max_position_embeddings=64))),
    # q directly, V2's softmax routing limited to the best group, two shared experts
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2, n_group=3, topk_group=2,
                         topk_method="group_limited_greedy", q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=2, moe_intermediate_size=32,
                         routed_scaling_factor=1.5)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                    router_jitter_noise=0.3, sliding_window=None)),
}


def hf_family(name: str, seed: int = 0, **overrides):
    transformers = pytest.importorskip("transformers")
    config_class, model_class, knobs = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**(COMMON | knobs | overrides)))
    with torch.no_grad():  # norms and biases away from their initial ones and zeros, so that a wrong one shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("bias", "sinks")):
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3's choosing bias, zeros until trained
                b.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    hf = hf_family(request.param)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(path)
    return request.param, hf, path


def test_logits_and_greedy_tokens_match_transformers(family):
    name, hf, path = family
    model = MoEModel.from_pretrained(path)
    assert model.config.family == name.split("-")[0]
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(getattr(layer, "mlp", None)
                                                                         or layer.block_sparse_moe, "experts")]
    assert list(model.config.dense_layers) == dense  # transformers' dense layers are ours
    ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    assert (model(ids) - want).abs().max().item() < 1e-4
    prompt = ids[0, :6].tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 6:].tolist()
    want_tokens = out[:out.index(2)] if 2 in out else out
    assert model.generate([prompt], max_new_tokens=12)[0] == want_tokens


# Every attention strategy (layer, replicated, tensor) and every experts one (expert, tensor, layer) once, on 2, 3
# and 4 ranks: four rank groups a family, each started in a few seconds on 2 cores.
LAYOUTS = [dict(gpus=3), dict(gpus=2, attention="replicated", experts="tensor"), dict(gpus=4, attention="tensor"),
           dict(gpus=2, experts="layer")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_n_ranks_under_each_strategy_give_the_one_rank_tokens(family):
    name, _, path = family
    prompts = [[1, 9, 33, 7, 5, 12], [1, 40, 41]]
    with MoEModel.from_pretrained(path) as one:
        want, ids = one.generate(prompts, max_new_tokens=10), torch.tensor([prompts[0]])
        logits = one(ids)
    for layout in LAYOUTS:
        if layout.get("attention") == "tensor" and name == "olmoe":
            with pytest.raises(ValueError, match="attention 'tensor' would split the q and k norms"):
                MoEModel.from_pretrained(path, **layout)
            layout = {k: v for k, v in layout.items() if k != "attention"}  # the same ranks, attention by layer
        with MoEModel.from_pretrained(path, **layout) as model:
            assert model.generate(prompts, max_new_tokens=10) == want, layout
            assert (model(ids) - logits).abs().max().item() < 1e-5, layout


def test_a_save_loads_in_transformers_as_its_family(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    name, hf, path = family
    with MoEModel.from_pretrained(path) as model:
        model.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(again) is type(hf)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("name", ["qwen3_moe-unnormalised", "qwen2_moe", "deepseek_v3"])
def test_a_reshard_of_a_family_with_dense_blocks_loads_in_transformers(name, tmp_path):
    """`scripts/shard.py` on a family with dense blocks among MoE ones (which have no experts to write)."""
    transformers = pytest.importorskip("transformers")
    hf = hf_family(name)
    hf.save_pretrained(tmp_path / "hf")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "shard.py"), "--ckpt", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "out"), "--gpus", "2", "--max-shard-size", "100KB", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, layout", [("granitemoe", dict(gpus=2)), ("gpt_oss", dict(gpus=3)),
                                          ("granitemoe", dict(gpus=2, experts="tensor"))])
def test_a_save_from_n_ranks_of_3d_expert_tensors_loads_in_transformers(name, layout, tmp_path):
    """Each block's experts are one Hub tensor that no rank holds whole: a holder gathers and writes it."""
    transformers = pytest.importorskip("transformers")
    hf = hf_family(name)
    hf.save_pretrained(tmp_path / "hf")
    with MoEModel.from_pretrained(tmp_path / "hf", **layout) as model:
        model.save_pretrained(tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_the_compiled_decode_step_gives_the_eager_tokens(name, tmp_path):
    """Sinks and windows alternating per block; latent attention's absorbed form on a static-shape cache."""
    hf_family(name).save_pretrained(tmp_path / name)
    prompts = [[1, 9, 33, 7, 5, 12], [1, 40, 41]]
    eager = MoEModel.from_pretrained(tmp_path / name).generate(prompts, max_new_tokens=10)
    assert MoEModel.from_pretrained(tmp_path / name, compile=True).generate(prompts, max_new_tokens=10) == eager


@pytest.mark.parametrize("name", ["qwen3_moe", "granitemoe"])
def test_fused_expert_tensors_as_transformers_5_writes_them_load_too(name, tmp_path):
    """`save_pretrained(save_original_format=False)`: each block's experts as 3-D `gate_up_proj`/`down_proj`."""
    hf = hf_family(name)
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    model = MoEModel.from_pretrained(tmp_path / "fused")
    assert model.info.format == "hf-fused"
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4
    with MoEModel.from_pretrained(tmp_path / "fused", gpus=2, experts="tensor") as two:  # slices of 3-D rows
        assert (two(ids) - model(ids)).abs().max().item() < 1e-5


def test_mixtral_fused_as_transformers_5_writes_it_loads(tmp_path):
    from tests.checkpoints import hf_model

    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (MoEModel.from_pretrained(tmp_path / "fused")(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_a_model_type_of_another_name_is_read_by_its_architecture():
    """Kimi-K2 ships model_type "kimi_k2" with DeepseekV3ForCausalLM, as vLLM reads it."""
    from models.config import ModelConfig

    cfg = ModelConfig.from_hf(dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                                   num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, vocab_size=128,
                                   n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1))
    assert (cfg.family, cfg.router, cfg.latent, cfg.n_experts) == ("deepseek_v3", "deepseek_v3", True, 8)


def test_families_and_fields_not_run_are_refused_in_one_line(tmp_path):
    from models.config import ConfigError, ModelConfig

    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96, vocab_size=128)
    cases = [
        (dict(model_type="bert"), "model_type 'bert' is not supported; supported: mixtral, mistral, llama, qwen3_moe"),
        (dict(model_type="deepseek_v2", num_attention_heads=4, topk_method="noaux"),
         "topk_method 'noaux' is not supported; supported: greedy, group_limited_greedy"),
        (dict(model_type="deepseek_v3", attention_bias=True), "attention_bias is not supported for multi-head latent"),
        (dict(model_type="deepseek_v3", num_attention_heads=4, n_routed_experts=8, n_group=3),
         "n_group=3 must divide the 8 experts and topk_group=1 lie in 1..n_group"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(model_type="llama", mlp_bias=True), "mlp_bias is not supported"),
        (dict(model_type="gpt_oss", layer_types=["sliding_attention", "chunked_attention"]),
         "layer_types must list 2 of sliding_attention, full_attention"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            ModelConfig.from_hf(base | fields)
