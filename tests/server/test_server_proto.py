"""The generated generate.v3 stubs: importable, identical in descriptor to TGI's proto, usable on the TGI image's pins.

``TGI_DESCRIPTOR_SHA256`` is the SHA-256 of the ``FileDescriptorProto`` that protoc compiles from TGI's
``proto/v3/generate.proto`` at commit ``TGI_COMMIT`` (file name ``generate.proto``, no source info,
``json_name`` cleared as the Python gencode embeds it, deterministic serialization). It was computed once
from TGI's file with the same steps as :func:`_compile`; TGI's file is not in this repository. Equal
digests mean our stubs and TGI's ``text_generation_server.pb`` register the same bytes, so both import
into one process without protobuf's "duplicate file name" error.

``EXPECTED`` restates the schema field by field: (name, number, type, label) where label is ``opt`` for
proto3 ``optional``, ``rep`` for repeated and ``one:<oneof>`` for oneof members, so a digest failure
points at the field that drifted.

``integration/tgi_pins/check.sh`` runs this file (with the rest of tests/server) on the TGI image's pins.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.internal import api_implementation

from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

PB_DIR = Path(pb.__file__).parent

TGI_COMMIT = "db931fcf42da018a3657580c64bf2720f167f9ab"
"""huggingface/text-generation-inference, 2026-01-08 (3.3.6-dev0); proto/v3/generate.proto last changed in 0c9b6cd."""
TGI_DESCRIPTOR_SHA256 = "ca79a35742389d18e826a748f71da5dad7fde2c721064ef5d2bbf35898b795e5"
"""sha256 of TGI's compiled generate.proto at ``TGI_COMMIT`` (see the module docstring)."""

EXPECTED: dict[str, list[tuple[str, int, str, str]]] = {
    "HealthRequest": [],
    "HealthResponse": [],
    "InfoRequest": [],
    "ServiceDiscoveryRequest": [],
    "ClearCacheResponse": [],
    "InfoResponse": [
        ("requires_padding", 1, "bool", ""),
        ("dtype", 2, "string", ""),
        ("device_type", 3, "string", ""),
        ("window_size", 4, "uint32", "opt"),
        ("speculate", 5, "uint32", ""),
        ("support_chunking", 6, "bool", ""),
        ("use_prefix_caching", 7, "bool", ""),
        ("attention_impl", 8, "string", ""),
        ("block_size", 9, "uint32", ""),
    ],
    "ServiceDiscoveryResponse": [("urls", 1, "string", "rep")],
    "ClearCacheRequest": [("id", 1, "uint64", "opt")],
    "Image": [("data", 1, "bytes", ""), ("mimetype", 2, "string", "")],
    "InputChunk": [("text", 1, "string", "one:chunk"), ("image", 2, ".generate.v3.Image", "one:chunk")],
    "Input": [("chunks", 1, ".generate.v3.InputChunk", "rep")],
    "NextTokenChooserParameters": [
        ("temperature", 1, "float", ""),
        ("top_k", 2, "uint32", ""),
        ("top_p", 3, "float", ""),
        ("typical_p", 4, "float", ""),
        ("do_sample", 5, "bool", ""),
        ("seed", 6, "uint64", ""),
        ("repetition_penalty", 7, "float", ""),
        ("watermark", 8, "bool", ""),
        ("frequency_penalty", 9, "float", ""),
        ("grammar", 10, "string", ""),
        ("grammar_type", 11, ".generate.v3.GrammarType", ""),
    ],
    "StoppingCriteriaParameters": [
        ("max_new_tokens", 1, "uint32", ""),
        ("stop_sequences", 2, "string", "rep"),
        ("ignore_eos_token", 3, "bool", ""),
    ],
    "Request": [
        ("id", 1, "uint64", ""),
        ("inputs", 2, "string", ""),
        ("truncate", 3, "uint32", ""),
        ("parameters", 4, ".generate.v3.NextTokenChooserParameters", ""),
        ("stopping_parameters", 5, ".generate.v3.StoppingCriteriaParameters", ""),
        ("prefill_logprobs", 6, "bool", ""),
        ("top_n_tokens", 7, "uint32", ""),
        ("input_chunks", 8, ".generate.v3.Input", ""),
        ("blocks", 9, "uint32", "rep"),
        ("slots", 10, "uint32", "rep"),
        ("adapter_id", 11, "string", "opt"),
        ("cache_len", 12, "uint32", ""),
        ("add_special_tokens", 13, "bool", ""),
        ("chunk_len", 14, "uint32", "opt"),
    ],
    "Batch": [
        ("id", 1, "uint64", ""),
        ("requests", 2, ".generate.v3.Request", "rep"),
        ("size", 3, "uint32", ""),
        ("max_tokens", 4, "uint32", ""),
        ("max_blocks", 5, "uint32", ""),
    ],
    "CachedBatch": [
        ("id", 1, "uint64", ""),
        ("request_ids", 2, "uint64", "rep"),
        ("size", 3, "uint32", ""),
        ("max_tokens", 4, "uint32", ""),
        ("current_tokens", 5, "uint32", ""),
    ],
    "GeneratedText": [
        ("text", 1, "string", ""),
        ("generated_tokens", 2, "uint32", ""),
        ("finish_reason", 3, ".generate.v3.FinishReason", ""),
        ("seed", 4, "uint64", "opt"),
    ],
    "Tokens": [
        ("ids", 1, "uint32", "rep"),
        ("logprobs", 2, "float", "rep"),
        ("texts", 3, "string", "rep"),
        ("is_special", 4, "bool", "rep"),
    ],
    "Generation": [
        ("request_id", 1, "uint64", ""),
        ("prefill_tokens", 2, ".generate.v3.Tokens", ""),
        ("tokens", 3, ".generate.v3.Tokens", ""),
        ("generated_text", 4, ".generate.v3.GeneratedText", "opt"),
        ("top_tokens", 5, ".generate.v3.Tokens", "rep"),
    ],
    "FilterBatchRequest": [("batch_id", 1, "uint64", ""), ("request_ids", 2, "uint64", "rep")],
    "FilterBatchResponse": [("batch", 1, ".generate.v3.CachedBatch", "")],
    "PrefillRequest": [("batch", 1, ".generate.v3.Batch", ""), ("cached_batch", 2, ".generate.v3.CachedBatch", "")],
    "DecodeRequest": [("batches", 1, ".generate.v3.CachedBatch", "rep")],
    "WarmupRequest": [
        ("batch", 1, ".generate.v3.Batch", ""),
        ("max_input_tokens", 2, "uint32", "opt"),
        ("max_prefill_tokens", 3, "uint32", ""),
        ("max_total_tokens", 4, "uint32", "opt"),
    ],
    "WarmupResponse": [
        ("max_supported_total_tokens", 1, "uint32", "opt"),
        ("max_input_tokens", 2, "uint32", ""),
        ("max_total_tokens", 3, "uint32", ""),
    ],
}
_STEP_RESPONSE = [
    ("generations", 1, ".generate.v3.Generation", "rep"),
    ("batch", 2, ".generate.v3.CachedBatch", "opt"),
    ("forward_ns", 3, "uint64", ""),
    ("decode_ns", 4, "uint64", ""),
    ("total_ns", 5, "uint64", ""),
    ("concat_ns", 6, "uint64", "opt"),
]
EXPECTED["PrefillResponse"] = _STEP_RESPONSE
EXPECTED["DecodeResponse"] = _STEP_RESPONSE

EXPECTED_ENUMS = {
    "GrammarType": {"GRAMMAR_TYPE_NONE": 0, "GRAMMAR_TYPE_JSON": 1, "GRAMMAR_TYPE_REGEX": 2},
    "FinishReason": {"FINISH_REASON_LENGTH": 0, "FINISH_REASON_EOS_TOKEN": 1, "FINISH_REASON_STOP_SEQUENCE": 2},
}
EXPECTED_METHODS = {
    name: (f"{name}Request", f"{name}Response")
    for name in ("Info", "ServiceDiscovery", "ClearCache", "FilterBatch", "Warmup", "Prefill", "Decode", "Health")
}

_TYPE_NAMES = {
    F.TYPE_BOOL: "bool",
    F.TYPE_STRING: "string",
    F.TYPE_BYTES: "bytes",
    F.TYPE_UINT32: "uint32",
    F.TYPE_UINT64: "uint64",
    F.TYPE_FLOAT: "float",
}


def _file_proto() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    return proto


def _describe(message: descriptor_pb2.DescriptorProto) -> list[tuple[str, int, str, str]]:
    rows = []
    for f in message.field:
        kind = f.type_name if f.type in (F.TYPE_MESSAGE, F.TYPE_ENUM) else _TYPE_NAMES[f.type]
        if f.label == F.LABEL_REPEATED:
            label = "rep"
        elif f.proto3_optional:
            label = "opt"
        elif f.HasField("oneof_index"):
            label = "one:" + message.oneof_decl[f.oneof_index].name
        else:
            label = ""
        rows.append((f.name, f.number, kind, label))
    return sorted(rows, key=lambda row: row[1])


def test_schema_matches_tgi_generate_v3() -> None:
    proto = _file_proto()
    assert proto.package == "generate.v3" and proto.syntax == "proto3"
    assert {m.name: _describe(m) for m in proto.message_type} == {
        name: sorted(rows, key=lambda row: row[1]) for name, rows in EXPECTED.items()
    }
    assert {e.name: {v.name: v.number for v in e.value} for e in proto.enum_type} == EXPECTED_ENUMS
    (service,) = proto.service
    assert service.name == "TextGenerationService"
    assert {m.name: (m.input_type, m.output_type) for m in service.method} == {
        name: (f".generate.v3.{i}", f".generate.v3.{o}") for name, (i, o) in EXPECTED_METHODS.items()
    }
    assert not any(m.client_streaming or m.server_streaming for m in service.method)


def test_round_trip_keeps_u64_ids_and_optional_presence() -> None:
    request = pb.Request(
        id=2**64 - 1,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text="hi")]),
        chunk_len=0,
        parameters=pb.NextTokenChooserParameters(seed=2**64 - 1),
    )
    decoded = pb.Request.FromString(request.SerializeToString())
    assert decoded == request and decoded.id == 2**64 - 1 and decoded.parameters.seed == 2**64 - 1
    assert decoded.HasField("chunk_len") and not decoded.HasField("adapter_id")
    response = pb.PrefillResponse(batch=pb.CachedBatch(id=2**64 - 1, request_ids=[0, 2**64 - 1], size=2))
    decoded_response = pb.PrefillResponse.FromString(response.SerializeToString())
    assert decoded_response.HasField("batch") and not decoded_response.HasField("concat_ns")
    assert list(decoded_response.batch.request_ids) == [0, 2**64 - 1]
    assert not pb.PrefillResponse.FromString(pb.PrefillResponse().SerializeToString()).HasField("batch")


def test_grpc_stub_paths_use_the_v3_service_name() -> None:
    text = (PB_DIR / "generate_pb2_grpc.py").read_text()
    for method in EXPECTED_METHODS:
        assert f"'/generate.v3.TextGenerationService/{method}'" in text
    assert hasattr(pb_grpc, "TextGenerationServiceStub")
    assert hasattr(pb_grpc, "add_TextGenerationServiceServicer_to_server")


def test_generated_code_runs_on_tgi_image_pins() -> None:
    """protoc stamps minimum runtime versions into the files: they must allow protobuf 5.29.4 / grpcio 1.71.0."""
    pb2 = (PB_DIR / "generate_pb2.py").read_text()
    match = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", pb2
    )
    if match:  # absent in gencode older than protobuf 5.26, which any runtime accepts
        assert tuple(map(int, match.groups())) <= (5, 29, 4)
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (PB_DIR / "generate_pb2_grpc.py").read_text())
    if grpc_version:
        assert tuple(map(int, grpc_version.group(1).split("."))) <= (1, 71, 0)
    assert "from . import generate_pb2 as generate__pb2" in (PB_DIR / "generate_pb2_grpc.py").read_text()


def _compile(proto_dir: Path, out: Path) -> descriptor_pb2.FileDescriptorProto:
    """protoc's FileDescriptorProto of ``proto_dir/generate.proto``: no source info, ``json_name`` cleared
    (the Python gencode does not embed it)."""
    from grpc_tools import protoc

    assert (
        protoc.main(["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}", str(proto_dir / "generate.proto")]) == 0
    )
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    for message in compiled.message_type:
        for f in message.field:
            f.ClearField("json_name")
    return compiled


def _digest(proto: descriptor_pb2.FileDescriptorProto) -> str:
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()


_needs_protoc = pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed (the dev extra has it)"
)


@_needs_protoc
def test_compiled_proto_is_byte_identical_to_tgis(tmp_path: Path) -> None:
    compiled = _compile(PB_DIR, tmp_path / "set.pb")
    assert compiled.name == "generate.proto" and compiled.package == "generate.v3"
    assert _digest(compiled) == TGI_DESCRIPTOR_SHA256, (
        f"generate.proto no longer compiles to TGI's descriptor (commit {TGI_COMMIT}): keep TGI's file name, "
        "package and the declaration order of messages, fields, enums and methods"
    )


def test_generated_stubs_register_tgis_exact_bytes() -> None:
    """What the gencode hands the descriptor pool is what TGI's gencode hands it."""
    assert hashlib.sha256(pb.DESCRIPTOR.serialized_pb).hexdigest() == TGI_DESCRIPTOR_SHA256, (
        "generate_pb2.py does not embed TGI's descriptor: run scripts/gen_proto.sh"
    )


@pytest.mark.skipif(
    api_implementation.Type() == "python", reason="the pure-Python protobuf runtime does not refuse a conflicting file"
)
def test_same_bytes_load_twice_in_one_pool_but_a_reordered_file_does_not() -> None:
    """The mechanism the digest guards: the default (upb) runtime accepts a second registration of
    ``generate.proto`` only when its bytes are identical (as when both our stubs and TGI's are imported)."""
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(pb.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(pb.DESCRIPTOR.serialized_pb)  # TGI's stubs, by the digest above
    reordered = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    request = next(m for m in reordered.message_type if m.name == "Request")
    by_number = sorted(request.field, key=lambda f: f.number)  # the wire-compatible order we used to have
    del request.field[:]
    request.field.extend(by_number)
    with pytest.raises(TypeError, match="duplicate file name generate.proto"):
        pool.AddSerializedFile(reordered.SerializeToString())


@_needs_protoc
def test_generated_files_are_in_sync_with_the_proto(tmp_path: Path) -> None:
    assert _compile(PB_DIR, tmp_path / "set.pb") == _file_proto(), "generate_pb2.py is stale: run scripts/gen_proto.sh"
