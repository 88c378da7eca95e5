"""Prefill/decode disaggregation: a prefill server computes prompts, a decode server streams
their outputs, and each prompt's KV moves between their pools through a transfer engine.

The flow of one request, which `radixserve router --pd-disaggregation` sends to both servers
with the same `bootstrap_room`:
1. the decode server matches the prompt in its own radix tree, reserves slots for the rest and
   tells the prefill server's bootstrap listener where they are (`KVDestination`);
2. the prefill server runs the prompt (its radix tree skips shared prefixes), samples the
   first token, writes the KV pages the decode server lacks straight into its pool
   (`transfer`), then tells it the first token (`KVArrived`) and answers the router;
3. the decode server puts the received prompt into its radix tree (so follow-ups hit there)
   and decodes the rest.
A transfer that does not finish within `--disaggregation-transfer-timeout` fails its request
with a 503 on both sides; the decode server keeps the slots it reserved out of use until no
late write can land in them.
"""


def start_transfers(args, pool, ctx):
    """This side's transfers (`prefill.PrefillTransfers` or `decode.DecodeTransfers`), or None
    when the server is not disaggregated. ValueError: the engine or the bootstrap cannot start."""
    import zmq

    from .decode import DecodeTransfers
    from .prefill import PrefillTransfers

    sides = {"prefill": PrefillTransfers, "decode": DecodeTransfers}
    side = sides.get(args.disaggregation_mode)
    if side is None:
        return None
    try:
        return side(args, pool, ctx)
    except zmq.ZMQError as exc:
        raise ValueError(
            f"disaggregation: cannot listen on {args.disaggregation_host} "
            f"(--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port}?): {exc}"
        ) from None
