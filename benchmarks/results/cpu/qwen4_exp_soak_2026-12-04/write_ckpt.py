import sys

from hyserve.testing.qwen4_exp import write_tiny_qwen4_exp_checkpoint

G, A = "linear_attention", "full_attention"
NINE = [G, G, A, G, G, A, G, A, G]   # stages 3,3,2,1: attention on stages 0-2, PLE (layers 2, 5, 9) on stages 0, 1, 3
print(write_tiny_qwen4_exp_checkpoint(sys.argv[1], form="vlm", layer_types=NINE, ple_layer_ids=[2, 5, 9],
                                      indexer_n_heads=8, with_mtp=True))
