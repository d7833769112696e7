"""The vLLM connector's pure parts, without vLLM and without a network: block keys (tenants and
layouts never share one, pages chain layer by layer and block by block), the settings read from
kv_connector_extra_config (each bad one refused with a message naming it), and the scheduler side's
save plan (only newly full blocks of known tokens, each once, none vLLM had before the request ran).
tests/test_vllm_connector_cluster.py and test_vllm_connector_faults.py run the sides against kvnodes."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_connector.keys import block_keys, block_pages, last_layer_keys, layer_page_key
from vllm_connector.placement import Placement
from vllm_connector.scheduler_side import SchedulerSide
from vllm_connector.settings import Settings, SettingsError
from vllm_connector_helpers import BLOCK_SIZE, LAYOUT, NUM_LAYERS, PAGE_BYTES, node_table, settings, tokens
from worker.kv.pages import KEY_BYTES

# ---- keys ---------------------------------------------------------------------------------------

FP = LAYOUT.fingerprint()
PROMPT = tokens(5 * BLOCK_SIZE + 3, seed=1)


def test_block_keys_are_deterministic_and_chain_each_block_on_the_ones_before():
    keys = block_keys(FP, "", PROMPT, BLOCK_SIZE, 5)
    assert keys == block_keys(LAYOUT.fingerprint(), "", list(PROMPT), BLOCK_SIZE, 5)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == KEY_BYTES for k in keys)
    assert block_keys(FP, "", PROMPT, BLOCK_SIZE, 3) == keys[:3]  # a prefix's keys are the prefix of the keys
    changed = list(PROMPT)
    changed[2 * BLOCK_SIZE] += 1  # the first token of block 2: blocks 2, 3, 4 change, 0 and 1 do not
    other = block_keys(FP, "", changed, BLOCK_SIZE, 5)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))


def test_a_cache_salt_changes_every_key():
    keys = block_keys(FP, "", PROMPT, BLOCK_SIZE, 5)
    for salt in ("tenant-a", "tenant-b"):
        salted = block_keys(FP, salt, PROMPT, BLOCK_SIZE, 5)
        assert not set(salted) & set(keys)
    assert not set(block_keys(FP, "tenant-a", PROMPT, BLOCK_SIZE, 5)) & set(block_keys(FP, "tenant-b", PROMPT,
                                                                                        BLOCK_SIZE, 5))


@pytest.mark.parametrize("field, value", [("kv_dtype", "torch.float16"), ("block_size", 32),
                                          ("engine_version", "0.0.test2"), ("model", "test/other-llama"),
                                          ("model_config", '{"num_hidden_layers": 5}'), ("platform", "cuda"),
                                          ("page_bytes", 8192), ("num_kv_heads", 4), ("head_size", 64)])
def test_any_other_layout_field_changes_the_fingerprint_and_every_key(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    assert other.fingerprint() != FP and len(other.fingerprint()) == KEY_BYTES
    assert dataclasses.replace(other, **{field: getattr(LAYOUT, field)}).fingerprint() == FP
    mine = block_keys(FP, "", PROMPT, BLOCK_SIZE, 5)
    theirs = block_keys(other.fingerprint(), "", PROMPT, BLOCK_SIZE, 5)
    assert not set(mine) & set(theirs)
    assert not set(last_layer_keys(mine, NUM_LAYERS)) & set(last_layer_keys(theirs, NUM_LAYERS))


def test_block_pages_chain_layer_by_layer_and_a_block_on_the_last_layer_of_the_one_before():
    keys = block_keys(FP, "", PROMPT, BLOCK_SIZE, 3)
    pages, parents = [], []
    for b, key in enumerate(keys):
        k, p = block_pages(key, keys[b - 1] if b else None, NUM_LAYERS)
        assert k == [layer_page_key(key, layer) for layer in range(NUM_LAYERS)]
        pages += k
        parents += p
    assert len(set(pages)) == 3 * NUM_LAYERS
    assert parents == [b""] + pages[:-1]  # one chain: every page's parent is the page before it
    assert last_layer_keys(keys, NUM_LAYERS) == [pages[(b + 1) * NUM_LAYERS - 1] for b in range(3)]
    assert layer_page_key(keys[0], 0) != layer_page_key(keys[1], 0) != layer_page_key(keys[0], 1)


def test_block_keys_refuse_too_few_tokens():
    assert len(block_keys(FP, "", PROMPT[:2 * BLOCK_SIZE], BLOCK_SIZE, 2)) == 2
    with pytest.raises(ValueError, match="need 48 token ids, got 47"):
        block_keys(FP, "", PROMPT[:3 * BLOCK_SIZE - 1], BLOCK_SIZE, 3)
    assert block_keys(FP, "", [], BLOCK_SIZE, 0) == []


# ---- settings -----------------------------------------------------------------------------------

def test_settings_accept_a_good_config_with_a_list_or_a_comma_string_of_addresses(tmp_path):
    good = Settings.from_extra_config({"coordinators": ["10.0.0.1:50050", "10.0.0.2:50050"], "replicas": 3,
                                       "lookup_timeout_s": 1, "lease_ms": 5000, "save": False, "model_id": "llama"})
    assert good.coordinators == ("10.0.0.1:50050", "10.0.0.2:50050") and good.kvnodes == ()
    assert (good.replicas, good.lookup_timeout_s, good.lease_ms, good.save) == (3, 1.0, 5000, False)
    assert isinstance(good.lookup_timeout_s, float)
    assert Settings.from_extra_config({"coordinators": " a:1, b:2 ,"}).coordinators == ("a:1", "b:2")
    assert Settings.from_extra_config({"kvnodes": "n:7"}).kvnodes == ("n:7",)
    assert Settings.from_extra_config({"kvnodes": ("n:7",)}).save_buffer_mib == 512  # defaults kept
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert Settings.from_extra_config({"kvnodes": ["n:7"], "token_file": str(token_file)}).client_token() == "s3cret"
    assert Settings.from_extra_config({"kvnodes": ["n:7"], "token": "t0k"}).client_token() == "t0k"
    assert settings("n:7").client_token() is None and settings("n:7").credentials() is None


@pytest.mark.parametrize("extra, named", [
    ({"kvnodes": ["n:1"], "lookup_timeout": 1.0}, "lookup_timeout"),                  # unknown key
    ({"kvnodes": ["n:1"], "coordinators": ["c:1"]}, "coordinators"),                  # both
    ({}, "coordinators"),                                                             # neither
    ({"kvnodes": "", "coordinators": ""}, "kvnodes"),                                 # neither, as empty strings
    ({"kvnodes": [1, 2]}, "kvnodes"),                                                 # wrong types
    ({"kvnodes": 7}, "kvnodes"),
    ({"kvnodes": ["n:1"], "replicas": "2"}, "replicas"),
    ({"kvnodes": ["n:1"], "save": "yes"}, "save"),
    ({"kvnodes": ["n:1"], "save_buffer_mib": True}, "save_buffer_mib"),
    ({"kvnodes": ["n:1"], "token": 1234}, "token"),
    ({"kvnodes": ["n:1"], "lease_ms": -1}, "lease_ms"),                               # negative numbers
    ({"kvnodes": ["n:1"], "load_timeout_s": -0.5}, "load_timeout_s"),
    ({"kvnodes": ["n:1"], "lookup_timeout_s": 0}, "lookup_timeout_s"),                # zero where it cannot be
    ({"kvnodes": ["n:1"], "refresh_s": 0.0}, "refresh_s"),
    ({"kvnodes": ["n:1"], "tls_ca": "ca.pem", "tls_cert": "w.pem"}, "tls_key"),       # cert without key
    ({"kvnodes": ["n:1"], "tls_ca": "ca.pem", "tls_key": "w.key"}, "tls_cert"),
    ({"kvnodes": ["n:1"], "tls_cert": "w.pem", "tls_key": "w.key"}, "tls_ca"),
    ({"kvnodes": ["n:1"], "token": "t", "token_file": "f"}, "token_file"),
])
def test_settings_refuse_a_bad_config_naming_the_key(extra, named):
    with pytest.raises(SettingsError, match=named):
        Settings.from_extra_config(extra)


@pytest.mark.parametrize("extra, named", [
    ({"lease_ms": 2**32}, "lease_ms"),  # every Lookup would raise ValueError (a uint32) out of the scheduler
    ({"lookup_timeout_s": float("nan")}, "lookup_timeout_s"),  # every lookup a miss
    ({"load_timeout_s": float("inf")}, "load_timeout_s"),
    ({"save_buffer_mib": 0.5}, "save_buffer_mib"),  # was truncated to 0: nothing ever saved
    ({"replicas": 1.5}, "replicas"),
])
def test_settings_refuse_numbers_that_would_break_later_naming_the_key(extra, named):
    with pytest.raises(SettingsError, match=named):
        Settings.from_extra_config({"kvnodes": ["n:1"], **extra})
    assert Settings.from_extra_config({"kvnodes": ["n:1"], "replicas": 2.0, "lease_ms": 2**32 - 1}).replicas == 2


def test_tls_and_token_files_are_read_at_start_and_a_bad_one_is_named(tmp_path, certs):
    """connector.py turns itself off with a warning on a SettingsError from from_extra_config; a file
    read only later (building the node table, the coordinator client) raised out of vLLM's start."""
    good = {"kvnodes": ["n:1"], "tls_ca": str(certs / "ca.pem"), "tls_cert": str(certs / "worker.pem"),
            "tls_key": str(certs / "worker.key")}
    assert Settings.from_extra_config(good).credentials() is not None
    for name, path in (("tls_ca", tmp_path / "missing.pem"), ("tls_key", certs / "ca.pem")):
        with pytest.raises(SettingsError, match=name):
            Settings.from_extra_config({**good, name: str(path)})
    with pytest.raises(SettingsError, match="token_file .*nonexistent"):
        Settings.from_extra_config({"kvnodes": ["n:1"], "token_file": str(tmp_path / "nonexistent")})


def test_token_file_takes_the_run_directorys_tokens_file_as_clients_do(tmp_path):
    """`cluster up --secure` writes RUN_DIR/tokens (TENANT TOKEN lines): its `default` tenant is the
    clients', another is picked with `tenant`; a bare token works as before."""
    run_tokens = tmp_path / "tokens"
    run_tokens.write_text("# written by cluster up\ndefault default-t0k-0123456789 shared\nteam-a team-a-t0k-0123456789\n")

    def read(**extra):
        return Settings.from_extra_config({"kvnodes": ["n:1"], "token_file": str(run_tokens), **extra}).client_token()
    assert read() == "default-t0k-0123456789" and read(tenant="team-a") == "team-a-t0k-0123456789"
    with pytest.raises(SettingsError, match="token_file .* names no tenant 'team-b'; it names default, team-a"):
        read(tenant="team-b")
    with pytest.raises(SettingsError, match="tenant picks a tenant of a tokens file: give that file as token_file"):
        Settings.from_extra_config({"kvnodes": ["n:1"], "token": "t", "tenant": "team-a"})
    bare = tmp_path / "bare"
    bare.write_text("only-t0k\n")
    with pytest.raises(SettingsError, match="holds a token alone, not tenants: tenant has none to pick"):
        Settings.from_extra_config({"kvnodes": ["n:1"], "token_file": str(bare), "tenant": "team-a"})


# ---- the save plan --------------------------------------------------------------------------------

@pytest.fixture
def scheduler():
    """A scheduler side over one kvnode address nothing listens on: plan() asks no node anything."""
    s = settings("127.0.0.1:9")
    side = SchedulerSide(s, LAYOUT, Placement(s, PAGE_BYTES), node_table())
    try:
        yield side
    finally:
        side.close()
        side.nodes.close()


def _saved(plan) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(request, first block, blocks in the chain, vLLM blocks) of each save."""
    return [(s.req_id, s.first, len(s.block_keys), s.block_ids) for s in plan.saves]


def test_plan_saves_only_newly_full_blocks_of_known_tokens_each_once(scheduler):
    live = tokens(2 * BLOCK_SIZE + 8, seed=2)  # vLLM's list of the request's tokens: it grows as it decodes
    scheduler.start("r", live, "", [10, 11, 12], 0)
    plan = scheduler.plan({"r": len(live)})
    assert _saved(plan) == [("r", 0, 2, (10, 11))]
    assert plan.saves[0].addresses == ("127.0.0.1:9",)
    assert list(plan.saves[0].block_keys) == block_keys(FP, "", live, BLOCK_SIZE, 2)
    assert _saved(scheduler.plan({"r": len(live)})) == []  # nothing new: nothing saved twice
    live += tokens(7, seed=3)  # 47 tokens: block 2 not full yet
    assert _saved(scheduler.plan({"r": len(live)})) == []
    # Computed tokens vLLM has no token ids for yet (a step scheduled past them): block 2 waits for them.
    assert _saved(scheduler.plan({"r": 3 * BLOCK_SIZE})) == []
    live.append(5)
    plan = scheduler.plan({"r": 3 * BLOCK_SIZE})
    assert _saved(plan) == [("r", 2, 3, (12,))]
    assert list(plan.saves[0].block_keys) == block_keys(FP, "", live, BLOCK_SIZE, 3)
    live += tokens(BLOCK_SIZE, seed=4)
    assert _saved(scheduler.plan({"r": 4 * BLOCK_SIZE})) == []  # block 3 has no vLLM block yet
    scheduler.grow("r", [13])
    assert _saved(scheduler.plan({"r": 4 * BLOCK_SIZE})) == [("r", 3, 4, (13,))]
    assert _saved(scheduler.plan({"r": 4 * BLOCK_SIZE})) == []
    scheduler.finished("r")
    live += tokens(BLOCK_SIZE, seed=5)
    assert _saved(scheduler.plan({"r": 5 * BLOCK_SIZE})) == []  # a finished request is forgotten


def test_plan_does_not_save_what_vllm_had_when_the_request_started_nor_again_after_a_preemption(scheduler):
    live = tokens(4 * BLOCK_SIZE + 1, seed=6)
    scheduler.start("hit", live, "t", [4, 5, 6, 7, 8], 2 * BLOCK_SIZE)  # vLLM's own prefix hit: 2 blocks
    plan = scheduler.plan({"hit": len(live)})
    assert _saved(plan) == [("hit", 2, 4, (6, 7))]
    assert list(plan.saves[0].block_keys) == block_keys(FP, "t", live, BLOCK_SIZE, 4)  # the request's salt
    live += tokens(BLOCK_SIZE, seed=7)
    scheduler.start("hit", live, "t", [20, 21, 22, 23, 24, 25], 0)  # resumed after a preemption: new blocks
    assert _saved(scheduler.plan({"hit": 4 * BLOCK_SIZE})) == []  # blocks 0-3 were saved already
    assert _saved(scheduler.plan({"hit": 5 * BLOCK_SIZE})) == [("hit", 4, 5, (24,))]


def test_plan_saves_nothing_with_save_off_but_still_hands_over_loads():
    s = settings("127.0.0.1:9", save=False)
    side = SchedulerSide(s, LAYOUT, Placement(s, PAGE_BYTES), node_table())
    try:
        side.start("r", tokens(3 * BLOCK_SIZE, seed=8), "", [1, 2, 3], 0)
        assert side.plan({"r": 3 * BLOCK_SIZE}).saves == []
    finally:
        side.close()
        side.nodes.close()


def test_a_prompt_within_vllms_own_hit_or_under_one_block_is_answered_at_once_without_a_lookup(scheduler):
    prompt = tokens(3 * BLOCK_SIZE, seed=9)
    assert scheduler.num_new_matched_tokens("short", prompt[:BLOCK_SIZE], "", 0) == (0, False)
    assert scheduler.num_new_matched_tokens("local", prompt, "", 2 * BLOCK_SIZE) == (0, False)
    assert scheduler._lookups == {}  # nothing asked of a node
