"""The leakage meter: attack this project's own traffic with public knowledge only.

    traffic.py   run prompts through a local swarm whose trunks capture what they see (the truth
                 the attack is scored against stays here, on the asker's side)
    capture.py   read a trunk's capture files: the attacker's whole view of the traffic
    tables.py    the head's output for every vocabulary token, precomputed from the GGUF
    invert.py    uplink inversion: hidden states back to token ids
    downlink.py  the public tail and LM head on what the last stage sends back
    attack.py    the attacker's entry point: a model path and capture files in, tokens out
    report.py    scoring against the truth, as a table and JSON
    noise.py     the optional mitigation: calibrated Gaussian noise on uplink activations
    quality.py   what the noise costs: perplexity of a fixed text, greedy agreement with a clean run
    meter.py     the whole audit, end to end
    texts.py     the fixed prompts and the calibration paragraph

The attack modules (capture, tables, invert, downlink, attack) take a model path and capture files and
nothing else: they import nothing from the asker.
"""
