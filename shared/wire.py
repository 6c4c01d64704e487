"""The only module that touches protobuf: plain objects (shared/protocol.py) <-> messages."""

from __future__ import annotations

from dataclasses import replace

from shared import protocol
from shared.errors import InvalidRequest
from shared.pb import verifier_pb2 as pb
from shared.protocol import AcceptMode, SamplingParams, SpecialToken

# Trailing-metadata key that carries the server's position on FAILED_PRECONDITION.
SERVER_POSITION_KEY = "specdec-server-position"
# Trailing metadata on RESOURCE_EXHAUSTED: milliseconds after which a retry may be admitted.
RETRY_AFTER_MS_KEY = "specdec-retry-after-ms"
# The same hint under gRPC's own name, which a channel's service-config retryPolicy honours.
RETRY_PUSHBACK_MS_KEY = "grpc-retry-pushback-ms"

_MODE_TO_PB = {
    AcceptMode.POINT: pb.ACCEPT_MODE_POINT,
    AcceptMode.SPARSE: pb.ACCEPT_MODE_SPARSE,
    AcceptMode.SCALAR: pb.ACCEPT_MODE_SCALAR,
    AcceptMode.SHORTCUT: pb.ACCEPT_MODE_SHORTCUT,
    AcceptMode.TOP1: pb.ACCEPT_MODE_TOP1,
}
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()}


def pack_mask(bits: list[bool]) -> bytes:
    """Bit i (LSB first within each byte) = bits[i]."""
    out = bytearray((len(bits) + 7) // 8)
    for i, bit in enumerate(bits):
        if bit:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def unpack_mask(data: bytes, length: int) -> list[bool]:
    """Inverse of pack_mask; `data` must hold exactly ceil(length / 8) bytes (checked by the caller)."""
    return [bool(data[i // 8] >> (i % 8) & 1) for i in range(length)]


def sampling_to_pb(params: SamplingParams) -> pb.SamplingConfig:
    return pb.SamplingConfig(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, repetition_penalty=params.repetition_penalty
    )


def sampling_from_pb(msg: pb.SamplingConfig) -> SamplingParams:
    # proto3 zero means "unset": map it to the processor's neutral value. Anything else,
    # negative or NaN included, goes on as sent for the verifier to accept or refuse.
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0,
    )


def config_from_pb(sampling: pb.SamplingConfig, seed: int, mode: int, vocab_size: int) -> protocol.SessionConfig:
    params = sampling_from_pb(sampling)
    if params.greedy:
        accept_mode = AcceptMode.GREEDY
    else:
        if mode == pb.ACCEPT_MODE_UNSPECIFIED:
            accept_mode = AcceptMode.POINT
        elif mode in _MODE_FROM_PB:
            accept_mode = _MODE_FROM_PB[mode]  # type: ignore[index]
        else:
            raise InvalidRequest(f"unknown accept_mode {mode}")
    return protocol.SessionConfig(params, seed, accept_mode, vocab_size)


def open_request_to_pb(req: protocol.OpenSessionRequest) -> pb.OpenSessionRequest:
    cfg = req.config
    return pb.OpenSessionRequest(
        prompt_tokens=req.prompt_tokens,
        sampling=sampling_to_pb(cfg.sampling),
        seed=cfg.seed,
        accept_mode=_MODE_TO_PB.get(cfg.accept_mode, pb.ACCEPT_MODE_UNSPECIFIED),
        vocab_size=cfg.vocab_size,
        reuse_token=req.reuse_token,
        grammar=grammar_to_pb(cfg.grammar),
    )


def open_request_from_pb(msg: pb.OpenSessionRequest) -> protocol.OpenSessionRequest:
    cfg = config_from_pb(msg.sampling, msg.seed, msg.accept_mode, msg.vocab_size)
    cfg = replace(cfg, grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None)
    return protocol.OpenSessionRequest(list(msg.prompt_tokens), cfg, msg.reuse_token)


def grammar_to_pb(grammar: protocol.GrammarSpec | None) -> pb.Grammar | None:
    if grammar is None:
        return None
    return pb.Grammar(text=grammar.text, stop_token_ids=grammar.stop_ids, generated=grammar.generated)


def grammar_from_pb(msg: pb.Grammar) -> protocol.GrammarSpec:
    return protocol.GrammarSpec(msg.text, tuple(msg.stop_token_ids), msg.generated)


def open_result_to_pb(res: protocol.OpenSessionResult) -> pb.OpenSessionResponse:
    return pb.OpenSessionResponse(
        session_id=res.session_id,
        position=res.position,
        max_draft_tokens=res.max_draft_tokens,
        vocab_size=res.vocab_size,
        prefill_ms=res.prefill_ms,
        model_id=res.model_id,
        reuse_token=res.reuse_token,
        reused_tokens=res.reused_tokens,
    )


def open_result_from_pb(msg: pb.OpenSessionResponse) -> protocol.OpenSessionResult:
    return protocol.OpenSessionResult(
        msg.session_id,
        msg.position,
        msg.max_draft_tokens,
        msg.vocab_size,
        msg.prefill_ms,
        msg.model_id,
        reuse_token=msg.reuse_token,
        reused_tokens=msg.reused_tokens,
    )


def verify_request_to_pb(req: protocol.VerifyRequest) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        session_id=req.session_id,
        base_position=req.base_position,
        committed_tokens=req.committed_tokens,
        draft_tokens=req.draft_tokens,
        draft_probs=req.draft_probs,
        hard_mask=pack_mask(req.hard_mask),
        sparse_draft=[pb.SparseDistribution(token_ids=s.token_ids, probs=s.probs) for s in req.sparse_draft],
        want_top_k=req.want_top_k,
        request_id=req.request_id,
    )


def verify_request_from_pb(msg: pb.VerifyRequest) -> protocol.VerifyRequest:
    """Structure only; the verifier validates values. The mask's byte length is checked
    here because unpacking a wrong-length mask would silently pad or drop bits."""
    k = len(msg.draft_tokens)
    if msg.hard_mask and len(msg.hard_mask) != (k + 7) // 8:
        raise InvalidRequest(f"hard_mask has {len(msg.hard_mask)} bytes, expected {(k + 7) // 8} for {k} drafts")
    return protocol.VerifyRequest(
        session_id=msg.session_id,
        base_position=msg.base_position,
        draft_tokens=list(msg.draft_tokens),
        draft_probs=list(msg.draft_probs),
        committed_tokens=list(msg.committed_tokens),
        hard_mask=unpack_mask(msg.hard_mask, k) if msg.hard_mask else [],
        sparse_draft=[protocol.SparseDistribution(list(s.token_ids), list(s.probs)) for s in msg.sparse_draft],
        want_top_k=msg.want_top_k,
        request_id=msg.request_id,
    )


def verify_result_to_pb(res: protocol.VerifyResult) -> pb.VerifyResponse:
    m = res.metrics
    return pb.VerifyResponse(
        accepted_len=res.accepted_len,
        next_token=res.next_token,
        bonus=res.bonus,
        new_base_position=res.new_base_position,
        metrics=pb.RoundMetrics(
            alpha_mean=m.alpha_mean,
            la_over_k=m.la_over_k,
            verify_ms=m.verify_ms,
            queue_ms=m.queue_ms,
            forward_ms=m.forward_ms,
            hard_tokens=m.hard_tokens,
            alpha_prefix=m.alpha_prefix,
        ),
        target_top_k=[pb.TopK(token_ids=t.token_ids, probs=t.probs) for t in res.target_top_k],
        prefer_speculation=res.prefer_speculation,
    )


def verify_result_from_pb(msg: pb.VerifyResponse) -> protocol.VerifyResult:
    m = msg.metrics
    return protocol.VerifyResult(
        accepted_len=msg.accepted_len,
        next_token=msg.next_token,
        bonus=msg.bonus,
        new_base_position=msg.new_base_position,
        metrics=protocol.RoundMetrics(
            m.alpha_mean,
            m.la_over_k,
            m.verify_ms,
            m.queue_ms,
            m.forward_ms,
            m.hard_tokens,
            m.alpha_prefix if m.HasField("alpha_prefix") else None,
        ),
        target_top_k=[protocol.SparseDistribution(list(t.token_ids), list(t.probs)) for t in msg.target_top_k],
        prefer_speculation=msg.prefer_speculation,
    )


def close_result_to_pb(res: protocol.CloseSessionResult) -> pb.CloseSessionResponse:
    return pb.CloseSessionResponse(position=res.position, rounds=res.rounds)


def close_result_from_pb(msg: pb.CloseSessionResponse) -> protocol.CloseSessionResult:
    return protocol.CloseSessionResult(msg.position, msg.rounds)


def generate_request_to_pb(req: protocol.GenerateRequest) -> pb.GenerateRequest:
    cfg = req.config
    return pb.GenerateRequest(
        prompt_tokens=req.prompt_tokens,
        sampling=sampling_to_pb(cfg.sampling),
        seed=cfg.seed,
        max_new_tokens=req.max_new_tokens,
        stop_token_ids=req.stop_token_ids,
        vocab_size=cfg.vocab_size,
        reuse_token=req.reuse_token,
        grammar=grammar_to_pb(cfg.grammar),
    )


def generate_request_from_pb(msg: pb.GenerateRequest) -> protocol.GenerateRequest:
    cfg = config_from_pb(msg.sampling, msg.seed, pb.ACCEPT_MODE_UNSPECIFIED, msg.vocab_size)
    cfg = replace(cfg, grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None)
    return protocol.GenerateRequest(list(msg.prompt_tokens), cfg, msg.max_new_tokens, list(msg.stop_token_ids), msg.reuse_token)


def generate_chunk_to_pb(chunk: protocol.GenerateChunk) -> pb.GenerateChunk:
    return pb.GenerateChunk(
        tokens=chunk.tokens,
        forward_ms=chunk.forward_ms,
        finished=chunk.finished,
        reuse_token=chunk.reuse_token,
        reused_tokens=chunk.reused_tokens,
    )


def generate_chunk_from_pb(msg: pb.GenerateChunk) -> protocol.GenerateChunk:
    return protocol.GenerateChunk(
        list(msg.tokens), msg.forward_ms, msg.finished, reuse_token=msg.reuse_token, reused_tokens=msg.reused_tokens
    )


def decode_request_to_pb(req: protocol.DecodeRequest) -> pb.DecodeRequest:
    msg = pb.DecodeRequest(
        session_id=req.session_id,
        base_position=req.base_position,
        committed_tokens=req.committed_tokens,
        max_tokens=req.max_tokens,
        stop_token_ids=req.stop_token_ids,
    )
    if req.open is not None:
        msg.open.CopyFrom(open_request_to_pb(req.open))
    return msg


def decode_request_from_pb(msg: pb.DecodeRequest) -> protocol.DecodeRequest:
    """Structure only; the verifier validates values. A request names its session or opens one."""
    opening = msg.HasField("open")
    if opening == bool(msg.session_id):
        raise InvalidRequest("a Decode call sets exactly one of session_id and open")
    return protocol.DecodeRequest(
        session_id=msg.session_id,
        base_position=msg.base_position,
        max_tokens=msg.max_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        committed_tokens=list(msg.committed_tokens),
        open=open_request_from_pb(msg.open) if opening else None,
    )


def decode_chunk_to_pb(chunk: protocol.DecodeChunk) -> pb.DecodeChunk:
    msg = pb.DecodeChunk(
        tokens=chunk.tokens,
        position=chunk.position,
        forward_ms=chunk.forward_ms,
        step_ms=chunk.step_ms,
        finished=chunk.finished,
        prefer_speculation=chunk.prefer_speculation,
    )
    if chunk.opened is not None:
        msg.opened.CopyFrom(open_result_to_pb(chunk.opened))
    return msg


def decode_chunk_from_pb(msg: pb.DecodeChunk) -> protocol.DecodeChunk:
    opened = open_result_from_pb(msg.opened) if msg.HasField("opened") else None
    return protocol.DecodeChunk(
        list(msg.tokens), msg.position, msg.forward_ms, msg.step_ms, msg.finished, opened, msg.prefer_speculation
    )


def description_to_pb(d: protocol.ModelDescription) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        model_id=d.model_id,
        parameters=d.parameters,
        logits_width=d.logits_width,
        has_tokenizer=d.has_tokenizer,
        tokenizer_size=d.tokenizer_size,
        vocab_block_size=d.block_size,
        vocab_block_digests=list(d.block_digests),
        special_tokens=[pb.SpecialToken(id=s.id, content=s.content) for s in d.special_tokens],
        chat_template_sha256=d.chat_template_sha256,
        decode_step_ms=d.decode_step_ms,
        tokens=list(d.tokens),
        chat_template=d.chat_template,
    )


def description_from_pb(msg: pb.DescribeResponse) -> protocol.ModelDescription:
    return protocol.ModelDescription(
        model_id=msg.model_id,
        parameters=msg.parameters,
        logits_width=msg.logits_width,
        has_tokenizer=msg.has_tokenizer,
        tokenizer_size=msg.tokenizer_size,
        block_size=msg.vocab_block_size,
        block_digests=tuple(msg.vocab_block_digests),
        special_tokens=tuple(SpecialToken(s.id, s.content) for s in msg.special_tokens),
        chat_template_sha256=msg.chat_template_sha256,
        decode_step_ms=msg.decode_step_ms,
        tokens=tuple(msg.tokens),
        chat_template=msg.chat_template,
    )
