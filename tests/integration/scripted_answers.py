"""A ``FakeShard.mutate`` hook that makes constrained requests answer with scripted tokens.

Requests whose ``NextTokenChooserParameters.grammar`` is set get ``pieces`` as their token texts, one
per step, then EOS (``</s>``, special) with ``generated_text`` = the pieces joined; a request whose
``max_new_tokens`` is shorter ends with ``length`` on the pieces so far. Requests without a grammar
keep the fake's letters. ``seen`` records the grammar (regex) of every scripted request.
"""

from __future__ import annotations

from typing import Any

from integration.router_replay.fake_shard import FakeShard
from tgi_paged_backend.server.pb import generate_pb2 as pb


class ScriptedAnswers:
    def __init__(self, shard: FakeShard, pieces: list[str]) -> None:
        self.shard = shard
        self.pieces = pieces
        self.steps: dict[int, int] = {}
        self.seen: list[tuple[int, str]] = []

    def _fake_request(self, request_id: int) -> Any:
        return next(r for batch in self.shard.batches.values() for r in batch if r.id == request_id)

    def __call__(self, method: str, request: Any, response: Any) -> Any:
        if method == "Prefill":
            for r in request.batch.requests:
                if r.parameters.grammar:
                    self.steps[r.id] = 0
                    self.seen.append((r.id, r.parameters.grammar))
        if method not in ("Prefill", "Decode"):
            return response
        for generation in response.generations:
            k = self.steps.get(generation.request_id)
            if k is None:
                continue
            self.steps[generation.request_id] = k + 1
            if k == 0 and not generation.HasField("generated_text"):
                fake = self._fake_request(generation.request_id)
                fake.max_new_tokens = min(fake.max_new_tokens, len(self.pieces) + 1)
            tokens = generation.tokens
            if k < len(self.pieces):
                tokens.texts[0], tokens.is_special[0] = self.pieces[k], False
                text = "".join(self.pieces[: k + 1])
            else:
                tokens.ids[0], tokens.texts[0], tokens.is_special[0] = self.shard.config.eos_id, "</s>", True
                text = "".join(self.pieces)
            if generation.HasField("generated_text"):
                generation.generated_text.text = text
                if k >= len(self.pieces):
                    generation.generated_text.finish_reason = pb.FINISH_REASON_EOS_TOKEN
        return response
