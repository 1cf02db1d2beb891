"""agentx.bench: AgentX-style trace benchmarks for agentx and peer engines.

    trace.py, trace_stats.py        the typed trace model; theoretical prefix hit rate
    fields.py                       typed field access that names file / record / field on error
    format_agentx.py                the SemiAnalysis AgentX ("weka") JSON format, read and write
    format_mooncake.py, loader.py   the Mooncake FAST'25 JSONL format; load either
    synth.py                        synthetic traces with the published statistics, --scale
    mixed.py                        a fixed trace of cold long first turns among warm turns (lanes)
    prompts.py                      hash ids -> deterministic blocks of text or of token ids
    corpus.py, data/                the committed text corpus text prompts are cut from
    segments.py                     a prompt as text / token-id segments; adapters tokenize
    closed_loop.py                  a turn's prompt = the last prompt + generated ids + new text
    adapter.py                      EngineAdapter (the ABC the replay drives) and its records
    fake_adapter.py                 FakeAdapter: simulated time per token, exact prefix cache
    agentx_adapter.py               AgentxAdapter: agentx in process
    agentx_vllm_adapter.py          AgentxVLLMAdapter: agentx on its vLLM backend
    worker_adapter.py               WorkerAdapter: any engine behind the worker protocol
    protocol.py, worker.py          the worker protocol; the agentx worker
    fake_worker.py                  the fake engine as a worker (tests drivers without a model)
    engines.py                      engine specs -> adapters
    replay.py, sweep.py             one replay; engines x concurrencies
    records.py, metrics.py          what was measured; TPGS, TTFT, interactivity, hit rates
    results.py, report.py, plots.py JSON results, Markdown, PNG plots
    saturate.py, saturate_report.py prefill-only / decode-only max tokens/s (``saturate``)
    pd_model.py                     xPyD vs colocated throughput predicted from that profile
    cli.py                          ``agentx bench`` / ``python -m agentx.bench``

Nothing in ``agentx`` imports this package; it imports the engine like any user would.
"""
