"""An OpenAI-compatible HTTP API, and Anthropic's Messages API, in front of the asker (``swarmctl serve``).

    http.py    HTTP/1.1 and HTTPS on aiohttp's server: limits (Slowloris too), whole and chunked responses
    sse.py     server-sent events the way OpenAI streams them
    params.py  request bodies → typed, validated parameters
    shapes.py  OpenAI's response and chunk objects
    errors.py  OpenAI's error shape, and which failure gets which status
    stops.py   stop strings in streamed text
    prompting.py  a chat request → the prompt's tokens and tools (OpenAI's and Anthropic's routes alike)
    anthropic_params.py, anthropic_shapes.py, anthropic_routes.py  the Anthropic Messages API
    server.py  the routes: auth, models, chat and text completions, and what / says
    startup.py 503 with Retry-After from the moment `serve` listens until the API is ready
"""
