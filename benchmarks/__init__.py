"""The measurement harness: one runner, `python -m benchmarks <measurement> [options]` (from the repo root).

It lives outside the package, as optimum-quanto keeps its bench: these measurements time and
compare the code (steps against their bytes floor, drafters, scaling, fidelity variants, the GPU
check), write a JSON report with an environment block plus a markdown table here in
`benchmarks/`, and need a source checkout. What a user runs on their own model ships in the
package: `quasar-hf bench` (Quasar against its peers) and `quasar-hf eval` (fidelity, lm-eval
tasks). The index of reports and the commands that made them is `benchmarks/README.md`.
"""
