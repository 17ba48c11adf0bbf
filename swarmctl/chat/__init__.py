"""`swarmctl chat`: the conversation and its slash commands (I/O-free), and the terminal loop."""
