"""Where model files come from: the bundled default or a path, and fetching exactly the tensors a
member needs from the host, other members and a mirror, checked chunk by chunk."""
