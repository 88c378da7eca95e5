"""Prefill/decode disaggregation: a prefill server computes prompts, a decode server streams
their outputs, and each prompt's KV moves between their pools through a transfer engine.

The flow of one request, which `radixserve router --pd-disaggregation` sends to both servers
with the same `bootstrap_room`:
1. the decode server matches the prompt in its own radix tree, reserves slots for the rest,
   registers a landing buffer for them and tells the prefill server's bootstrap listener where
   it is (`KVDestination`);
2. the prefill server runs the prompt (its radix tree skips shared prefixes), samples the
   first token, gathers the KV rows the decode server lacks and writes them into the landing
   buffer in one transfer (`transfer`; a hybrid model's state at the prompt's end follows the
   rows in the same buffer), then tells it the first token (`KVArrived`) and answers the
   router;
3. the decode server copies the rows into its reserved slots (the state into the request's
   row), puts the prompt into its radix tree (so follow-ups hit there) and decodes the rest.
A transfer that does not finish within `--disaggregation-transfer-timeout` fails its request
with a 503 on both sides; a late write can only land in the abandoned landing buffer, which
the decode server frees one timeout later.
"""


def start_transfers(args, runner, ctx):
    """This side's transfers (`prefill.PrefillTransfers` or `decode.DecodeTransfers`) of the
    model runner's KV pool (and a hybrid model's states), or None when the server is not
    disaggregated. ValueError: the engine or the bootstrap cannot start."""
    import zmq

    from .decode import DecodeTransfers
    from .prefill import PrefillTransfers
    from .transfer import RowStates

    sides = {"prefill": PrefillTransfers, "decode": DecodeTransfers}
    side = sides.get(args.disaggregation_mode)
    if side is None:
        return None
    info = runner.info.state_pool
    states = None if info is None else RowStates(runner.states, info.state_bytes)
    try:
        return side(args, runner.pool, ctx, states)
    except zmq.ZMQError as exc:
        raise ValueError(
            f"disaggregation: cannot listen on {args.disaggregation_host} "
            f"(--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port}?): {exc}"
        ) from None
