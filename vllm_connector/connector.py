"""KVCacheConnector: vLLM's KV connector API (KVConnectorBase_V1) over a kvcache cluster.

This module only translates between vLLM's objects and the two sides: scheduler_side.py (lookups,
the plan of each step) and worker_side.py (loads and saves). A setting or a layout the connector
cannot serve turns it off with one warning: vLLM then runs as without it.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm import __version__ as vllm_version
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole)
from vllm.platforms import current_platform

from vllm_connector.keys import BlockLayout
from vllm_connector.placement import Placement
from vllm_connector.plan import StepPlan
from vllm_connector.scheduler_side import SchedulerSide
from vllm_connector.settings import Settings, SettingsError
from vllm_connector.worker_side import WorkerSide
from worker.remote.nodes import NodeTable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm_connector")


def _log_through_vllm() -> None:
    """vLLM configures only its own loggers: ours (and the kvnode client's) write through its handlers."""
    handlers = logging.getLogger("vllm").handlers
    for name in ("vllm_connector", "worker.remote", "kvnode.client", "coordinator"):
        logger = logging.getLogger(name)
        if handlers and not logger.handlers:
            logger.handlers, logger.propagate = list(handlers), False
            logger.setLevel(logging.INFO)


_log_through_vllm()

NODE_INFO_TIMEOUT_S = 2.0
NODE_RETRY_S, NODE_MAX_RETRY_S = 2.0, 60.0
MAX_NODES = 256


class KVCacheConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


class KVCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._placement: Placement | None = None
        self._requests: dict[str, Request] = {}
        self._load_errors: set[int] = set()
        self._layout: BlockLayout | None = None
        try:
            self._settings = Settings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
            self._layout, self._layer_names = _layout(vllm_config, kv_cache_config, self._settings)
        except (SettingsError, _Unsupported) as exc:
            log.warning("kvcache connector off: %s", exc)
            return
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # A block that fails to arrive is recomputed, never a failed request.
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._placement = Placement(self._settings, self._layout.page_bytes)
            self._scheduler = SchedulerSide(self._settings, self._layout, self._placement, self._nodes())
            log.info("kvcache connector: %d kvnodes, pages of %d bytes (%d layers a block of %d tokens)",
                     self._placement.num_nodes(), self._layout.page_bytes, self._layout.num_layers,
                     self._layout.block_size)

    def _nodes(self) -> NodeTable:
        return NodeTable(self._layout.page_bytes, NODE_INFO_TIMEOUT_S, NODE_RETRY_S, NODE_MAX_RETRY_S, MAX_NODES,
                         max_probes=4, credentials=self._settings.credentials())

    # ---- scheduler side --------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        if self._scheduler is not None:
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None or request.prompt_token_ids is None:
            return 0, False
        self._requests.setdefault(request.request_id, request)
        return self._scheduler.num_new_matched_tokens(request.request_id, request.prompt_token_ids,
                                                      request.cache_salt or "", num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if self._scheduler is not None:
            self._scheduler.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVCacheConnectorMetadata(StepPlan())
        side, tokens = self._scheduler, scheduler_output.num_scheduled_tokens
        scheduled: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None or request.prompt_token_ids is None:
                continue
            side.start(new.req_id, request.all_token_ids, request.cache_salt or "", new.block_ids[0],
                       new.num_computed_tokens)
            scheduled[new.req_id] = new.num_computed_tokens + tokens.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            if request is None or request.prompt_token_ids is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                side.start(req_id, request.all_token_ids, request.cache_salt or "",
                           new_blocks[0] if new_blocks else [], cached.num_computed_tokens[i])
            elif new_blocks:
                side.grow(req_id, new_blocks[0])
            scheduled[req_id] = cached.num_computed_tokens[i] + tokens.get(req_id, 0)
        return KVCacheConnectorMetadata(side.plan(scheduled))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None  # saves copy their blocks out during the step: vLLM may free them now

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self._layout is None:
            return
        try:
            layers = [_page_rows(name, kv_caches[name], self._layout.page_bytes) for name in self._layer_names]
        except (_Unsupported, KeyError) as exc:
            log.warning("kvcache connector off: %s", exc)
            return
        self._worker = WorkerSide(self._settings, self._nodes(), layers)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_loads(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once all of its blocks arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # blocks are saved whole, after the step (wait_for_save)

    def wait_for_save(self):
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save(self._plan().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done, errors = self._worker.take_finished_loads()
        self._load_errors |= errors
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        if self._worker is not None:
            self._worker.wait_for_saves(timeout=self._settings.load_timeout_s)
            log.info("kvcache connector: %s", self._worker.counters)
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._placement is not None:
            self._placement.close()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        return metadata.plan if isinstance(metadata, KVCacheConnectorMetadata) else StepPlan()


class _Unsupported(Exception):
    pass


def _layout(vllm_config, kv_cache_config, settings: Settings) -> tuple[BlockLayout, list[str]]:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise _Unsupported(f"this model has {len(groups)} KV cache groups (a hybrid model); the connector "
                           "keeps models with one")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise _Unsupported("tensor and pipeline parallel engines are not supported yet (each rank holds a slice)")
    spec = groups[0].kv_cache_spec
    model_config = vllm_config.model_config
    hf = {k: v for k, v in model_config.hf_config.to_dict().items() if not k.startswith("_")}
    layout = BlockLayout(
        model=settings.model_id or model_config.model,
        model_config=json.dumps(hf, sort_keys=True, default=str),
        kv_dtype=str(spec.dtype), block_size=spec.block_size, num_layers=len(groups[0].layer_names),
        num_kv_heads=getattr(spec, "num_kv_heads", 0), head_size=getattr(spec, "head_size", 0),
        page_bytes=spec.page_size_bytes, platform=str(current_platform.device_type), engine_version=vllm_version)
    return layout, list(groups[0].layer_names)


def _page_rows(name: str, cache: torch.Tensor, page_bytes: int) -> np.ndarray:
    """One layer's KV cache as (num_blocks, page_bytes) uint8 rows sharing its memory."""
    if cache.device.type != "cpu":
        raise _Unsupported(f"layer {name} is on {cache.device}; the connector moves blocks of CPU engines only")
    block = cache[0]
    if block.numel() * block.element_size() != page_bytes or not block.is_contiguous():
        raise _Unsupported(f"layer {name}'s blocks are not {page_bytes} contiguous bytes (shape "
                           f"{tuple(cache.shape)}, strides {cache.stride()})")
    if not cache.is_contiguous():
        raise _Unsupported(f"layer {name}'s cache is not contiguous (strides {cache.stride()})")
    return cache.view(torch.uint8).numpy().reshape(cache.shape[0], page_bytes)
