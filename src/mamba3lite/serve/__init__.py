"""`mamba3lite serve`: an OpenAI-compatible HTTP server over one loaded run.

    engine.py        continuous batching: one decode loop, requests join and leave at step boundaries
    batch_state.py   the running batch's decode states: preallocated rows, swap-remove, a byte budget
    sampling.py      a request's sampling settings and its row's seeded token choice
    prefix_cache.py  the LRU of recurrent states at a prompt's token boundaries
    textout.py       generated tokens to text pieces, and stop strings matched across token boundaries
    protocol.py      request bodies to validated settings, OpenAI-style errors
    responses.py     engine events to OpenAI response bodies and server-sent-event streams
    chat.py          chat messages to a prompt (the run's chat template, or a documented plain one)
    metrics.py       the counters and gauges behind GET /metrics (Prometheus text)
    auth.py          the bearer key, compared in constant time
    api.py           the FastAPI app: the endpoints over the engine
    server.py        uvicorn on a pre-bound socket; SIGTERM / Ctrl-C as a graceful shutdown

Importing this package does nothing; FastAPI and uvicorn are imported only by api.py and the command.
"""
