from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "version", "page_bytes", "capacity_pages", "used_pages", "leased_pages", "free_pages", "max_keys_per_request", "max_message_bytes", "data_port", "ram_capacity_pages", "ram_used_pages", "disk_capacity_pages", "disk_used_pages", "dirty_pages", "data_host", "data_unix", "max_leases_per_call")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    RAM_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    RAM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DIRTY_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIX_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASES_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    page_bytes: int
    capacity_pages: int
    used_pages: int
    leased_pages: int
    free_pages: int
    max_keys_per_request: int
    max_message_bytes: int
    data_port: int
    ram_capacity_pages: int
    ram_used_pages: int
    disk_capacity_pages: int
    disk_used_pages: int
    dirty_pages: int
    data_host: str
    data_unix: str
    max_leases_per_call: int
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., page_bytes: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., leased_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., max_keys_per_request: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., ram_capacity_pages: _Optional[int] = ..., ram_used_pages: _Optional[int] = ..., disk_capacity_pages: _Optional[int] = ..., disk_used_pages: _Optional[int] = ..., dirty_pages: _Optional[int] = ..., data_host: _Optional[str] = ..., data_unix: _Optional[str] = ..., max_leases_per_call: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "lease_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    def __init__(self, hits: _Optional[int] = ...) -> None: ...

class GetPagesRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "checksums")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    checksums: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "parent", "data", "last", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    data: bytes
    last: bool
    checksum: bytes
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("outcomes",)
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PutReply.Outcome]
        STORED: _ClassVar[PutReply.Outcome]
        ALREADY_PRESENT: _ClassVar[PutReply.Outcome]
        REFUSED_NO_PARENT: _ClassVar[PutReply.Outcome]
        REFUSED_NO_ROOM: _ClassVar[PutReply.Outcome]
    OUTCOME_UNSPECIFIED: PutReply.Outcome
    STORED: PutReply.Outcome
    ALREADY_PRESENT: PutReply.Outcome
    REFUSED_NO_PARENT: PutReply.Outcome
    REFUSED_NO_ROOM: PutReply.Outcome
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedScalarFieldContainer[PutReply.Outcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[PutReply.Outcome, str]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("lookups", "hit_pages", "miss_pages", "puts", "stored_pages", "evictions", "refusals", "bytes_in", "bytes_out", "get_pages", "disk_reads", "disk_writes", "promotions", "demotions", "corrupted_pages_dropped", "orphaned_pages_dropped", "recovered_pages", "recovery_ms", "disk_errors", "reported_pages_dropped")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    GET_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_PAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_PAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_PAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hit_pages: int
    miss_pages: int
    puts: int
    stored_pages: int
    evictions: int
    refusals: int
    bytes_in: int
    bytes_out: int
    get_pages: int
    disk_reads: int
    disk_writes: int
    promotions: int
    demotions: int
    corrupted_pages_dropped: int
    orphaned_pages_dropped: int
    recovered_pages: int
    recovery_ms: int
    disk_errors: int
    reported_pages_dropped: int
    def __init__(self, lookups: _Optional[int] = ..., hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., puts: _Optional[int] = ..., stored_pages: _Optional[int] = ..., evictions: _Optional[int] = ..., refusals: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., get_pages: _Optional[int] = ..., disk_reads: _Optional[int] = ..., disk_writes: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., corrupted_pages_dropped: _Optional[int] = ..., orphaned_pages_dropped: _Optional[int] = ..., recovered_pages: _Optional[int] = ..., recovery_ms: _Optional[int] = ..., disk_errors: _Optional[int] = ..., reported_pages_dropped: _Optional[int] = ...) -> None: ...

class DropPagesRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DropPagesReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "placement", "no_cache", "request_id", "session_id", "resume_token_ids", "ignore_eos", "messages", "priority", "echo", "logprobs", "prompt_logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    placement: _containers.RepeatedScalarFieldContainer[str]
    no_cache: bool
    request_id: str
    session_id: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    priority: int
    echo: bool
    logprobs: int
    prompt_logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., placement: _Optional[_Iterable[str]] = ..., no_cache: _Optional[bool] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., priority: _Optional[int] = ..., echo: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: Candidate
    top: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, chosen: _Optional[_Union[Candidate, _Mapping]] = ..., top: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens_local", "cached_tokens_remote", "computed_tokens", "completion_tokens", "ttft_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_REMOTE_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens_local: int
    cached_tokens_remote: int
    computed_tokens: int
    completion_tokens: int
    ttft_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens_local: _Optional[int] = ..., cached_tokens_remote: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("text", "token_ids", "usage", "finish_reason", "logprobs", "prompt_token_ids", "prompt_text", "prompt_logprobs", "prompt_first_token")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: Usage
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_first_token: bytes
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_first_token: _Optional[bytes] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "version", "model", "fingerprint", "kv_dtype", "page_tokens", "page_bytes", "running", "waiting", "free_blocks", "total_blocks", "max_tokens_limit", "max_positions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: str
    model: str
    fingerprint: str
    kv_dtype: str
    page_tokens: int
    page_bytes: int
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    max_tokens_limit: int
    max_positions: int
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[str] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., page_tokens: _Optional[int] = ..., page_bytes: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., max_positions: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("role", "address", "capacity_bytes", "page_bytes", "model", "fingerprint")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    capacity_bytes: int
    page_bytes: int
    model: str
    fingerprint: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("member_id", "heartbeat_interval_ms")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    heartbeat_interval_ms: int
    def __init__(self, member_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class MemberLoad(_message.Message):
    __slots__ = ("used_pages", "capacity_pages", "hit_pages", "miss_pages", "evictions", "running", "waiting", "free_blocks", "total_blocks")
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    used_pages: int
    capacity_pages: int
    hit_pages: int
    miss_pages: int
    evictions: int
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    def __init__(self, used_pages: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., evictions: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "load")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    load: MemberLoad
    def __init__(self, member_id: _Optional[str] = ..., load: _Optional[_Union[MemberLoad, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("member_id",)
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    def __init__(self, member_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("member_id", "role", "address", "alive", "seconds_since_beat", "capacity_bytes", "page_bytes", "model", "load", "outstanding")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_BEAT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    role: str
    address: str
    alive: bool
    seconds_since_beat: float
    capacity_bytes: int
    page_bytes: int
    model: str
    load: MemberLoad
    outstanding: int
    def __init__(self, member_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., seconds_since_beat: _Optional[float] = ..., capacity_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., model: _Optional[str] = ..., load: _Optional[_Union[MemberLoad, _Mapping]] = ..., outstanding: _Optional[int] = ...) -> None: ...

class ClusterStatusReply(_message.Message):
    __slots__ = ("coordinator_id", "epoch", "replicas", "members")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    epoch: str
    replicas: int
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    def __init__(self, coordinator_id: _Optional[str] = ..., epoch: _Optional[str] = ..., replicas: _Optional[int] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ...) -> None: ...
