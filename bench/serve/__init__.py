"""A serving benchmark for any OpenAI-compatible server, like `vllm bench serve`.

    python -m bench.serve --url http://127.0.0.1:8000 --model MODEL [--concurrency-sweep 1,8,64] [--offline]

Modules: datasets (prompts), client (one timed stream), load (arrivals, concurrency, client
processes), metrics (summaries), offline (the engine alone, the pipeline tax), report and plots.
"""
