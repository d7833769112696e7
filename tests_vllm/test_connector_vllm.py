"""vLLM keeps and finds its KV blocks in kvcache: real vLLM engines (separate processes) beside a real
local cluster. Engine A answers prompts and saves their blocks; engine B, another process, finds them:
vLLM's num_cached_tokens counts them and B's greedy tokens equal those of an engine without the
connector. An altered page, a salted prompt and killed kvnodes cost hits, never tokens."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvcache.bench.vllm_run import BLOCK_TOKENS, connector_config, engine, local_cluster, wait_until_saved

FAULTS = Path(__file__).parent.parent / "tests" / "fault_injection"

PAGE_BYTES = 2 * BLOCK_TOKENS * 3 * 64 * 2  # K and V of one layer's block: SmolLM2's 3 KV heads of 64, bfloat16
LAYERS = 30
ALTERED_BLOCK = 3  # the kvnodes flip a bit in this block's first page of the first sequence they store


def family(name: str) -> list[str]:
    """Three prompts sharing a ~1,000-token prefix of their own."""
    prefix = f"Notes of {name}: " + " ".join(f"{name}{i}" for i in range(300))
    return [f"{prefix}\nQuestion {q}: what is {q} plus {q}?" for q in range(3)]


FAMILIES = {name: family(name) for name in ("altered", "shared", "salted", "replica", "lost")}


def full_blocks(prompt_tokens: int) -> int:
    """Tokens the cluster can give a prompt: whole blocks, never the last prompt token's."""
    return (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """Every family's answers from an engine without the connector."""
    with engine(model_dir, tmp_path_factory.mktemp("plain") / "plain.log") as plain:
        return {name: plain.ask(prompts) for name, prompts in FAMILIES.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = dict(os.environ, KVCACHE_TEST_ALTER_NTH_PAGE=str(ALTERED_BLOCK * LAYERS + 1))
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with local_cluster(tmp_path_factory.mktemp("cluster"), PAGE_BYTES, nodes=2, replicas=2, node_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def engines(model_dir, cluster, reference, tmp_path_factory):
    """Engine A, which answered every family (salted with "alice") and saved their blocks, and engine B, new."""
    logs = tmp_path_factory.mktemp("engines")
    config = connector_config(cluster.coordinators)
    with engine(model_dir, logs / "a.log", config) as a:
        for name, prompts in FAMILIES.items():  # "altered" first: the nodes alter the first sequence they store
            answers = a.ask(prompts, cache_salt="alice" if name == "salted" else None)
            assert [r["tokens"] for r in answers] == [r["tokens"] for r in reference[name]], name
        wait_until_saved([n.address for n in cluster.nodes])
    with engine(model_dir, logs / "b.log", config) as b:
        yield b


def test_a_second_engine_loads_the_prefix_from_kvcache_and_answers_as_without_it(engines, reference):
    answers = engines.ask(FAMILIES["shared"])
    assert [r["tokens"] for r in answers] == [r["tokens"] for r in reference["shared"]]
    first = answers[0]
    assert first["cached"] == full_blocks(first["prompt_tokens"]) >= 7 * BLOCK_TOKENS  # all from kvcache: B is new


def test_an_altered_page_is_recomputed_never_used(engines, reference):
    answers = engines.ask(FAMILIES["altered"][:1])
    assert answers[0]["tokens"] == reference["altered"][0]["tokens"]
    # The blocks before it were used; it and the later ones were recomputed (vLLM's num_cached_tokens
    # counts a load when it is planned, so the logs tell what happened).
    loaded = full_blocks(answers[0]["prompt_tokens"]) // BLOCK_TOKENS
    log = engines.log()
    assert f"failed its checksum; it is dropped there and {loaded - ALTERED_BLOCK} blocks are recomputed" in log
    assert f"({(loaded - ALTERED_BLOCK) * BLOCK_TOKENS} tokens affected)" in log


def test_two_cache_salts_never_share_a_block(engines, reference):
    bob = engines.ask(FAMILIES["salted"][:1], cache_salt="bob")
    assert bob[0]["cached"] == 0
    alice = engines.ask(FAMILIES["salted"][:1], cache_salt="alice")
    assert alice[0]["cached"] == full_blocks(alice[0]["prompt_tokens"])
    assert bob[0]["tokens"] == alice[0]["tokens"] == reference["salted"][0]["tokens"]


def test_killed_kvnodes_cost_hits_never_tokens(engines, cluster, reference):
    cluster.nodes[0].kill()  # SIGKILL: the replica serves what it held
    replica = engines.ask(FAMILIES["replica"][:1])
    assert replica[0]["tokens"] == reference["replica"][0]["tokens"]
    assert replica[0]["cached"] == full_blocks(replica[0]["prompt_tokens"])
    cluster.nodes[1].kill()  # no kvnode left: B recomputes
    lost = engines.ask(FAMILIES["lost"][:1])
    assert lost[0]["tokens"] == reference["lost"][0]["tokens"]
    assert lost[0]["cached"] == 0


def test_a_cluster_nobody_answers_is_one_warning_and_no_hits(model_dir, reference, tmp_path):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    with engine(model_dir, tmp_path / "nowhere.log", connector_config([nowhere])) as lonely:
        answers = lonely.ask(FAMILIES["shared"][:1])
        log = lonely.log()
    assert answers[0]["tokens"] == reference["shared"][0]["tokens"]
    assert answers[0]["cached"] == 0
    warnings = [line for line in log.splitlines() if "WARNING" in line and "kvcache" in line]
    assert len(warnings) == 1, warnings
    assert "no coordinator answered" in warnings[0] and nowhere in warnings[0]
