"""benchmarks/slot_line.py's report: a row a round and choice with its capacities, and each choice's mean over
the rounds (the timing itself needs a GPU)."""
from conftest import benchmark_module


def test_the_report_lists_each_round_and_the_means_by_choice():
    mod = benchmark_module("slot_line")
    run = dict(capacity=[[48, 48], [64, 48]], memory="1 tokens; BF16/resident 1.393x")
    rep = dict(date="d", device="gpu", commit="c", command="slot_line.py", layers=2, tokens=64, runs=[
        dict(run, round=0, choice="fewest", us=[90.0, 94.0], mean_us=92.0),
        dict(run, round=0, choice="lined", capacity=[[64, 64], [64, 64]], us=[84.0, 86.0], mean_us=85.0),
        dict(run, round=1, choice="fewest", us=[92.0, 96.0], mean_us=94.0)])
    text = mod.render(rep)
    assert "| 0 | lined: K 64 64 / V 64 64 | 84.0 86.0 | 85.0 | BF16/resident 1.393x |" in text
    assert "| 1 | fewest: K 48 48 / V 64 48 | 92.0 96.0 | 94.0 |" in text
    assert text.rstrip().endswith("Means over the rounds: fewest 93.0 us, lined 85.0 us")
