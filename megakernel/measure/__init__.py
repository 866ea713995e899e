"""What a step costs, measured: the HBM bandwidth and decode-step timing on a GPU (bandwidth), the
timeline build's per-instruction records decoded (timeline) and the cost model refitted to them
(timeline_fit), and the performance targets a benchmark is judged by (targets).
"""
