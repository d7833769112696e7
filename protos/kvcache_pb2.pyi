from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "version", "page_bytes", "capacity_pages", "used_pages", "leased_pages", "free_pages", "max_keys_per_request", "max_message_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    page_bytes: int
    capacity_pages: int
    used_pages: int
    leased_pages: int
    free_pages: int
    max_keys_per_request: int
    max_message_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., page_bytes: _Optional[int] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., leased_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., max_keys_per_request: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "parent", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("lookups", "hit_pages", "miss_pages", "puts", "stored_pages", "evictions", "refusals", "bytes_in", "bytes_out", "get_pages")
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
    def __init__(self, lookups: _Optional[int] = ..., hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., puts: _Optional[int] = ..., stored_pages: _Optional[int] = ..., evictions: _Optional[int] = ..., refusals: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., get_pages: _Optional[int] = ...) -> None: ...
