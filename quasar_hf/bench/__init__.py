"""Benchmarks and fidelity reports for quasar_hf.

Public entry points (import the submodule you need; nothing heavy is imported here):
  suites.load_suite(name) / load_suites(names)      offline prompt suites: "code", "grounded", "chat"
  runner.run_bench(reference_model, quantized_model, tokenizer, ...)   interleaved generation benchmark
  runner.bench_main(argv) / `quasar-hf bench ...`                      the same, end to end, with reports
  fidelity.evaluate_fidelity(model, reference_model, tokenizer, texts, ...)  perplexity, top-1, KL, L
  report.write_reports(result, out_dir)             JSON (+ environment), markdown, PNG plots
  kernels.run_kernel_benchmark(...)                 kernel micro-benchmark (W8A8 backends vs BF16)
The research measurements (not shipped) run from a source checkout: `python -m benchmarks --help`.
"""
