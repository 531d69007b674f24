"""Corruptions of a vLLM engine's weights after a push (issue 56 item 2), for the tests that check a push by
content: each runs in vLLM's worker through `llm.collective_rpc`."""


def take_down_proj(worker) -> dict:
    """What `layers.0.mlp.down_proj` holds now: its packed CPU kernel (if any) and its weight tensor."""
    layer = worker.model_runner.get_model().get_submodule("model.layers.0.mlp.down_proj")
    return {"kernel": getattr(layer, "cpu_linear", None), "weight": layer.weight.detach().clone()}


def stale_down_proj(first: dict):
    """A worker function giving `layers.0.mlp.down_proj` back what `take_down_proj` took, as a push that left that
    layer stale would leave it."""

    def restore(worker):
        layer = worker.model_runner.get_model().get_submodule("model.layers.0.mlp.down_proj")
        if first.get("kernel") is not None:
            layer.cpu_linear = first["kernel"]
        if first["weight"].numel():
            layer.weight.data.copy_(first["weight"])

    return restore


def swap_embedding_rows(worker, rows=(40000, 40001)) -> None:
    """Swap two rows of the embedding (near the top of a 49,152-token vocabulary; tied: the output head's too)."""
    weight = worker.model_runner.get_model().get_submodule("model.embed_tokens").weight
    a, b = rows
    weight.data[[a, b]] = weight.data[[b, a]].clone()
