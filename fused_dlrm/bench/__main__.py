"""python -m fused_dlrm.bench <suite> [options]; suites: embedding, tp, dlrm_step."""

import sys

from fused_dlrm.bench import dlrm_step, embedding, tp

SUITES = {"embedding": embedding.main, "tp": tp.main, "dlrm_step": dlrm_step.main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SUITES:
        sys.exit(f"usage: python -m fused_dlrm.bench {{{','.join(SUITES)}}} [options]")
    SUITES[sys.argv[1]](sys.argv[2:])
