"""scripts/bench.py's cases run in processes of their own and print one JSON line: the products-alone case, which
sets a decode step's weight products against whole steps (ours and llama.cpp's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moe.bench.collectives import collective_cost
from moe.bench.in_turns import (
    LAYOUTS,
    ONE_CORE,
    REFERENCES,
    decode_steps_in_turns,
    memory_short,
    print_steps_in_turns,
    torch_threads,
)
from moe.bench.llama_cpp import combine
from moe.bench.peer_turns import PRODUCTS, besides_products, decode_in_turns, print_decode_in_turns, ratios
from moe.bench.step_parts import compiled_step_parts, print_compiled_step_parts, print_pipeline_step_parts
from moe.cli.bench import print_comparisons, print_products
from tests.checkpoints import ROOT, SHIPPED, TRAINED


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_products_alone_case_prints_a_step_time(dtype):
    done = subprocess.run([sys.executable, "-m", "moe.cli.bench", "--case", "ours-products", "--ckpt", str(SHIPPED),
                           "--gpus", "1", "--dtype", dtype, "--threads", "1", "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < result["products_step_s"] < 1 and 0 < result["products_compiled_step_s"] < 1
    # an eager step's ops a block: the 2 that read weights (the attention half and the feed-forward half, each with
    # its products and the glue between them; the head's product spread over the blocks) and the few besides
    assert 2 < result["eager_products_per_block"] < 3 and 0 < result["eager_ops_per_block"] < 5


def test_products_alone_are_printed_with_their_read_bandwidth(capsys):
    print_products({"products_step_s": 0.008, "products_compiled_step_s": 0.007}, {"step_bytes": 214e6})
    out = capsys.readouterr().out
    assert "called from Python): 8.00 ms per step = 125.0 tok/s" in out
    assert "compiled): 7.00 ms per step = 142.9 tok/s" in out and "30.6 GB/s" in out


def test_two_rank_steps_are_set_against_the_one_rank_step(capsys):
    batches = {"decode8_step_s": 0.08, "decode32_step_s": 0.16, "tokens8_hash": "a"}
    rows = {"ours x1": {"decode1_step_s": 0.010},
            "ours x2": {"decode1_step_s": 0.025, "rows_per_block_per_token": [2.0], **batches},
            "ours-replicated x2": {"decode1_step_s": 0.019, **batches}}
    print_comparisons(rows, 2, type("Config", (), {"top_k": 2, "dim": 512}))
    out = capsys.readouterr().out
    assert "2 ranks: decode step 25.0 ms = 2.50 x the 1-rank step" in out
    assert "2 ranks, replicated attention: decode step 19.0 ms = 1.90 x the 1-rank step" in out
    assert "greedy tokens identical" in out


@pytest.mark.multiprocess
def test_layouts_measured_in_turns_give_step_times_and_the_one_rank_tokens():
    threads = torch.get_num_threads()
    # One eager and one compiled layout of LAYOUTS (each is checked against one rank in tests of its own). The
    # compiled one, on the trained checkpoint, is the step-parts test's layout and test_compiled_ranks' [tensor]
    # case: inductor's cache holds their graphs after the first (each cold compile of another graph cost a CI run
    # 25-50 s)
    layouts = ("replicated/tensor", "replicated/tensor, compiled")
    assert set(layouts) < set(LAYOUTS)
    steps, differ = decode_steps_in_turns(str(TRAINED), "float32", 2, 2, rounds=2, new_tokens=4, layouts=layouts)
    assert set(steps) == {*REFERENCES, ONE_CORE, *layouts} and all(0 < s < 1 for s in steps.values())
    assert torch.get_num_threads() == threads  # the 1-core model's turns set this process's threads, then restore
    assert differ == []  # fp32: every layout gives its 1-rank reference's tokens
    assert memory_short(str(TRAINED)) is None  # a few MB


def test_torch_threads_are_set_inside_and_restored_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(KeyError), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise KeyError
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.multiprocess
def test_a_collective_is_timed_idle_and_between_products_sleeping_and_polling():
    cost = collective_cost(2, 64, product_mb=1, calls=5)
    for case in ("idle", "working", "idle polled", "working polled"):
        assert 0 < cost[case]["median"] <= cost[case]["p90"] < 5, cost


def test_llama_cpp_sessions_before_and_after_ours_make_one_row():
    before = {"prefill_tokens": 512, "prefill_samples": [500.0, 510.0, 520.0], "decode_samples": [200.0, 190.0, 210.0],
              "model_bytes": 1}
    after = {**before, "prefill_samples": [600.0, 610.0, 620.0], "decode_samples": [230.0, 240.0, 250.0]}
    row = combine([before, after])
    assert row["sessions"] == 2 and len(row["decode_samples"]) == 6
    assert row["decode1_step_s"] == pytest.approx(1 / 220.0)  # the median of all six runs
    assert row["prefill_s"] == pytest.approx(512 / 560.0)


def test_steps_in_turns_are_printed_against_the_one_rank_step_of_their_mode(capsys):
    steps = {"1 rank": 0.004, "1 rank, compiled": 0.003, ONE_CORE: 0.005, "replicated/tensor": 0.008,
             "replicated/tensor, compiled": 0.0045}
    print_steps_in_turns(steps, [], 2, 8)
    out = capsys.readouterr().out
    assert "1 rank 4.00 ms; 1 rank, compiled 3.00 ms;" in out and f"{ONE_CORE} 5.00 ms = 1.67x" in out
    assert "replicated/tensor 8.00 ms = 2.00x" in out and "replicated/tensor, compiled 4.50 ms = 1.50x" in out


@pytest.mark.multiprocess
def test_a_compiled_two_rank_step_is_told_apart_into_its_sums_broadcast_and_computing(capsys):
    parts = compiled_step_parts(str(TRAINED), "float32", 2)
    for p in parts:
        assert 0 < p["sums"] < p["step"] < 1 and 0 < p["broadcast"] < p["step"]
        assert 0 < p["sum_median"] <= p["sum_p90"] <= p["sum_max"] < 5
    print_compiled_step_parts([{"step": 0.006, "sums": 0.002, "broadcast": 0.0005, "sum_median": 0.00015,
                                "sum_p90": 0.0003, "sum_max": 0.005}], 8, 0.0035)
    out = capsys.readouterr().out
    assert "8 sums over ranks 2.00 (one: median 0.15 / p90 0.30 / max 5.00)" in out
    assert "computing 3.50 = 1.00x the compiled 1-rank step" in out


@pytest.mark.multiprocess
def test_a_compiled_pipeline_step_is_told_apart_into_its_hand_offs_and_each_ranks_computing(capsys):
    first, last = compiled_step_parts(str(TRAINED), "float32", 2, "layer/layer")
    for p in (first, last):  # no sums over ranks in a pipeline; the token reaches rank 0 from the head's rank 1
        assert p["sums"] == 0 and "sum_median" not in p and 0 < p["broadcast"] < p["step"] < 1
    assert first["sent"] > 0 == first["waited"] and last["waited"] > 0 == last["sent"]  # hidden states 0 -> 1
    print_pipeline_step_parts([{"step": 0.005, "sums": 0, "broadcast": 0.0025, "sent": 0.0002, "waited": 0},
                               {"step": 0.005, "sums": 0, "broadcast": 0.0002, "sent": 0, "waited": 0.0023}], 0.004)
    out = capsys.readouterr().out
    assert "rank 0: step 5.00 ms, of which hidden states sent on 0.20, waited for 0.00, the token broadcast 2.50, " \
        "computing 2.30" in out and "rank 1: step 5.00 ms" in out and "computing 2.50" in out
    assert "the ranks' computing together 4.80 ms = 1.20x the floor" in out and "hand-offs 0.20 ms a step" in out


def test_decode_in_turns_with_a_peer_sets_each_round_against_the_peer_of_that_round(capsys):
    asked = []

    def peer(new_tokens: int) -> float:  # a stand-in for llama-bench's generation test: 10 ms a token, then 20
        asked.append(new_tokens)
        return 0.010 * len(asked)

    turns = decode_in_turns(str(SHIPPED), "float32", 1, peer, rounds=2, new_tokens=4, ours={"ours x1": {}},
                            products=True)
    assert asked == [4, 4] and set(turns["steps"]) == {"ours x1", "peer", PRODUCTS} and len(turns["read_gbs"]) == 2
    ours, alone = turns["steps"]["ours x1"], turns["steps"][PRODUCTS]
    assert len(ours) == len(alone) == 2 and all(0 < s < 1 for s in ours + alone)
    assert ratios(turns, "ours x1") == [pytest.approx(0.010 / ours[0]), pytest.approx(0.020 / ours[1])]
    assert besides_products(turns, "peer") == [pytest.approx(0.010 - alone[0]), pytest.approx(0.020 - alone[1])]
    print_decode_in_turns({"steps": {"ours x1": [0.004, 0.005, 0.006], "peer": [0.005, 0.005, 0.009]},
                           "read_gbs": [40.0, 80.0, 60.0]}, "llama.cpp F32")
    out = capsys.readouterr().out
    assert "(3 rounds, order reversed every other round): ours x1 200.0 tok/s; llama.cpp F32 200.0 tok/s" in out
    assert "read bandwidth 40.0-80.0 GB/s" in out
    assert "ours x1 vs llama.cpp F32, round by round: 1.25, 1.00, 1.50x; median 1.25x" in out
    print_decode_in_turns({"steps": {"ours x1": [0.004, 0.005, 0.006], "peer": [0.005, 0.005, 0.009],
                                     PRODUCTS: [0.003, 0.004, 0.004]}, "read_gbs": [40.0, 80.0, 60.0]}, "llama.cpp F32")
    out = capsys.readouterr().out
    assert "vs llama.cpp F32" in out and f"{PRODUCTS} vs" not in out  # the products alone are not a contender
    assert "products alone, compiled, median 4.00 ms; medians): ours x1 1.00 ms; llama.cpp F32 2.00 ms" in out
