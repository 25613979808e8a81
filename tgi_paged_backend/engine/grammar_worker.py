"""The grammar-compile process: ``python -m tgi_paged_backend.engine.grammar_worker``.

outlines-core holds the GIL while it builds an automaton (seconds for a large JSON schema over a 50k
vocabulary), so a compile on a thread would stall the step loop; it runs in this separate process
instead. A plain child interpreter, not ``multiprocessing``: nothing of the parent's ``__main__`` is
re-imported, and this module imports nothing heavy, so it starts fast and small.

Protocol: pickled messages on stdin, one pickled reply each on the original stdout (the process's
own ``print``s go to stderr): ``("vocabulary", Vocabulary)`` -> ``("ok", None)``, then
``("compile", regex)`` -> ``("ok", Index)`` or ``("error", message)``. EOF on stdin ends it.
"""

from __future__ import annotations

import os
import pickle
import sys

import outlines_core


def serve(requests, replies) -> None:
    vocabulary = None
    while True:
        try:
            kind, payload = pickle.load(requests)
        except EOFError:
            return
        reply: tuple[str, object]  # ("ok", None | Index) or ("error", message)
        try:
            if kind == "vocabulary":
                vocabulary, reply = payload, ("ok", None)
            else:
                reply = ("ok", outlines_core.Index(payload, vocabulary))
        except Exception as err:  # noqa: BLE001 - every failure goes back to the requester as text
            reply = ("error", f"{type(err).__name__}: {err}")
        pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()


def main() -> None:
    os.nice(10)  # compiles yield the cores to the step loop (on a small box they share them)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray output of anything in this process must not corrupt the replies
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
