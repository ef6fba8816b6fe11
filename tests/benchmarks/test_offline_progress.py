"""benchmarks/offline/offline_throughput.py shows its progress on stderr: a bar of the requests
done for the pdserve run and for each HF batch size, none with --quiet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.offline.throughput.args import parse_args
from benchmarks.offline.throughput.hf_run import run_hf
from benchmarks.offline.throughput.pdserve_run import run_pdserve
from benchmarks.offline.throughput.workload import make_workload
from engine.model.config import ModelConfig

ARGS = ["--num-requests", "5", "--prompt-len", "4", "8", "--output-len", "2", "3", "--hf-batch-sizes", "2,4",
        "--num-kv-blocks", "32"]


def final_bars(err: str) -> dict[str, str]:
    """Each bar's last state, by its description."""
    return {line.split(":")[0]: line for line in re.split(r"[\r\n]", err) if ": 100%|" in line}


@pytest.mark.timeout(120)
def test_each_run_has_a_bar_of_requests_done_on_stderr_and_quiet_has_none(llama_dir: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    args = parse_args(["--model", str(llama_dir), *ARGS], "offline throughput")
    vocab = ModelConfig.from_model_dir(str(llama_dir)).vocab_size
    prompts, out_lens = make_workload(args, vocab)
    run_pdserve(args, prompts, out_lens, vocab)
    run_hf(args, prompts, out_lens, vocab)
    out, err = capsys.readouterr()
    names = ("generate", "hf batch size 2", "hf batch size 4")  # pdserve's LLM.generate, then HF's
    bars = final_bars(err)
    assert all(" 5/5 " in bars.get(name, "") and "req/s" in bars[name] for name in names), err
    assert out == ""

    args.quiet = True
    run_pdserve(args, prompts, out_lens, vocab)
    assert capsys.readouterr().err == ""
