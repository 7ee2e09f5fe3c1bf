"""The GraphSAGE example runs end to end (one rank, tiny graph) and learns from the graph."""

from _scripts import load_script


def test_graphsage_example_beats_features_only():
    mod = load_script("examples/graphsage_chunkstore.py")
    out = mod.main(["--nodes", "2000", "--avg-degree", "10", "--epochs", "2", "--batch-size", "128",
                    "--batches-per-epoch", "6", "--fanouts", "5,5", "--eval-nodes", "400", "--hidden", "32"])
    hist = out["history"]
    acc = hist[-2]["test_acc"]
    ref = hist[-1]["features_only_acc"]
    assert acc > ref + 0.15, (acc, ref)
    assert hist[-2]["sampled_edges_per_s"] > 0
