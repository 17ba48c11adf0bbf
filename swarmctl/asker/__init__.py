"""The asker role: the ends of the U, on the machine whose text it is.

Text, token ids and logits stay here; only the head's activations travel. Its parts:

    head_tail   Asker: tokens → embedding → head layers, and tail layers → LM head → sampling,
                for many requests at once; the ``Trunk`` interface the middle is reached through
    link        SwarmLink: the ``Trunk`` over QUIC (the first stage's stream, the results stream
                at the last stage, failover)
    replay      ReplayTable: reroute and replay with no I/O (what to resend, what to free)
    plan_watch  PlanWatch: the host connection; the newest plan, reports to the host
    verify      VerifyingTrunk: ``--verify P``, spot checks of the trunk's results
    speculate   drafts (n-gram, a draft model) and exact acceptance for ``--speculate``
    trace       the per-token trace (``--trace``)
    session     the model, the Asker and its trunk, as ``ask`` and ``serve`` build them

Pieces every role uses (the home, the dialer and its path memo, batching, budgets) stay at
``swarmctl/``'s root.
"""
