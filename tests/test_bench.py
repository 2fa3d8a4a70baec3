"""tools/bench.py end to end on the tiny config: one warm-up + one timed PPO iteration of the project's own loop.

Run: python -m pytest tests/test_bench.py -q
"""
import json

import pytest

import bench
from plumbing.scale import llama_param_count


def test_bench_tiny_every_column_positive(tmp_path):
    out = tmp_path / "bench.json"
    result = bench.main(["--configs", "tiny", "--iters", "1", "--batch", "4", "--prompt-len", "4",
                         "--response-len", "3", "--threads", "1", "--bandwidth-mib", "32", "--json", str(out)])
    assert [r["config"] for r in result["rows"]] == ["tiny"] and result["skipped"] == []
    row = result["rows"][0]
    for col in bench.COLUMNS:
        assert isinstance(row[col], (int, float)) and row[col] > 0, (col, row[col])
    # scale.llama_param_count agrees with the parameters the model actually has
    assert row["params"] == row["params_counted"] == llama_param_count(bench.CONFIGS["tiny"]["llama"])
    # the batch roofline is never below one sequence's (the weight read is shared); the JSON is main's result
    assert row["roofline_tok_s_batch"] >= row["roofline_tok_s_seq"]
    assert json.loads(out.read_text())["rows"][0]["update_tokens"] == row["update_tokens"]


def test_bench_1b_skipped_on_cpu():
    # the GPU-only config is skipped with a note on the CPU (nothing is built, so this is instant)
    result = bench.main(["--configs", "1b", "--device", "cpu", "--bandwidth-mib", "8"])
    assert result["rows"] == [] and result["skipped"][0]["config"] == "1b"


def test_decode_roofline_hand_arithmetic():
    # decode_roofline against hand arithmetic for the tiny config in fp32, B = 2, P = 4, T = 3, 1 GB/s
    n = bench.CONFIGS["tiny"]["llama"]
    W = (llama_param_count(n) - 91 * 64) * 4            # weights read per step, embedding table excluded
    kv = 2 * 2 * 4 * 16 * 4                              # K,V × layers × kv heads × head dim × 4 bytes = 1024
    kv_read = kv * (4 + (3 - 1) / 2)                     # mean context 5 positions
    r = bench.decode_roofline(n, 4, 2, 4, 3, 1e9)
    assert r["weight_bytes_per_step"] == W and r["kv_bytes_per_token"] == kv == 1024
    assert r["kv_cache_bytes"] == kv * 2 * 7
    assert abs(r["roofline_tok_s_seq"] - 1e9 / (W + kv_read)) < 1e-6
    assert abs(r["roofline_tok_s_batch"] - 2e9 / (W + 2 * kv_read)) < 1e-6


def printed_json(output: str, first_key: str) -> dict:
    """The JSON object a script printed (indented, starting with `first_key`) among its other output lines."""
    start = output.rindex('{\n  "' + first_key + '"')
    return json.JSONDecoder().raw_decode(output[start:])[0]


@pytest.mark.slow
@pytest.mark.background(["tools/gpu_check.py", "--tiny", "--out", "check", "--steps", "2", "--threads", "1"])
def test_gpu_check_dry_run_on_the_cpu(background):
    """The GPU check script's own logic (every stage under --deepspeed, its token and time bookkeeping) on a 0.1 M
    model, so the script a lent GPU runs has run before: the whole script as a user runs it, in a folder of its own."""
    work, returncode, output = background
    assert returncode == 0, output[-3000:]
    report = printed_json(output, "params")
    results = report["stages"]
    assert [(r["variant"], r["stage"]) for r in results] == [("full", s) for s in ("sft", "rm", "critic+ppo")]
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in results)
    assert all(r["plan_gib"] > 0 for r in results)  # the plan's prediction beside each stage's measurement
    # each stage released its DeepSpeed engines (engine.release): no stage's optimizer states outlive it, which on
    # the GPU added every earlier stage's memory to the next one's peak
    assert [r["engines_left"] for r in results] == [0] * 3, results
    steady = report["steady"]  # check 2: iterations after the warm-up, the decoding bound, the update's FLOPs
    assert steady["iterations_timed"] >= 2 and steady["iteration_s"] > 0 and steady["generate_batch"] == 2
    assert steady["rollout_tok_s"] > 0 and steady["decode_bound_tok_s"] > 0 and steady["update_tflop"] > 0
    lora = report["lora_7b"]  # check 3 (a tiny model in the dry run): LoRA, two PPO iterations, the plan beside it
    assert lora["steps"] == 2 and lora["plan_gib"] > 0
    assert (work / "check" / "run-lora-7b" / "policy" / "adapter" / "adapter_config.json").is_file()
    assert not list((work / "check").glob("run-*/checkpoints")), "each check's checkpoints are deleted"


@pytest.mark.slow
@pytest.mark.background(["tools/bench.py", "world", "--small", "--variants", "1", "--steps", "2",
                          "--json", "bench.json"])
def test_bench_world_small_prints_every_number(background):
    """`tools/bench.py world` end to end on the notebooks' small world: one variant, two PPO steps (the numbers
    themselves mean nothing here: it runs beside the rest of the suite)."""
    work, returncode, output = background
    assert returncode == 0, output[-3000:]
    result = json.loads((work / "bench.json").read_text())
    assert "runs per hour" in output   # the printed table
    (row,) = result["rows"]
    for key in ("base_s", "variant_s", "ppo_s_per_iter", "runner_s", "runs_per_hour"):
        assert row[key] > 0, key
    assert set(row["base_stages"]) >= {"sft", "reward_model"} and "ppo" in row["variant_stages"]
    it = result["iteration"]
    assert it["mm_gflop"] > 0 and it["gemm_gflop_s"] > 0 and it["achieved_gflop_s"] > 0
