"""Stand-ins for the static decode step's accelerated paths on CPU: a ``torch.compile`` backend that counts
the graphs it traces, and CUDA graphs whose replay reruns the captured forward over the static buffers."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CountingBackend:
    """A ``torch.compile`` backend that runs the traced graph as is and keeps every graph it was given."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs.append(gm)
        return gm.forward


class FakeGraph:
    """A CUDA graph's stand-in on CPU: a replay recomputes the captured forward (which reads the static
    buffers) into the output tensor of the capture, as a real replay rewrites its captured output."""

    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.forward, self.out, self.replays = forward, out, 0

    def replay(self) -> None:
        self.out.copy_(self.forward())
        self.replays += 1


def fake_cuda_graphs(monkeypatch) -> list[FakeGraph]:
    """Patch ``decode_graphs`` to capture ``FakeGraph``s on CPU; returns the list the captures land in."""
    from tgi_paged_backend.runner.static import cuda_graphs as decode_graphs

    graphs: list[FakeGraph] = []

    def capture(forward: Callable[[], torch.Tensor], pool: object) -> tuple[FakeGraph, torch.Tensor]:
        with torch.inference_mode():
            graphs.append(FakeGraph(forward, forward()))
        return graphs[-1], graphs[-1].out

    monkeypatch.setattr(decode_graphs, "_capture", capture)
    monkeypatch.setattr(decode_graphs, "_warm_up", lambda forward, device: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return graphs
