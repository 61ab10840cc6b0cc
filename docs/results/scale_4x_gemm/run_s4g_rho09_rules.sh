#!/bin/bash
# 6.46M, the rest of the rule set at rho = 0.9 (../weight_divergence/protocol.md, "Added at
# 2026-12-05 05:40 UTC"): NVIDIA's tail+switch and SNIP under the run budget (their own out-dir,
# as at 0.8), then bf16_ends, attn_protected, mlp_only under the plan budget. Resumable.
set -x
: "${WT:?set WT}" "${BASES:?set BASES}"
here=$(cd "$(dirname "$0")" && pwd)
POLICIES='snip;tail+switch' OUT=runs/s4g_rho09_run EXTRA='--set snip.budget=run' bash $here/run_s4g_rho09.sh
POLICIES='bf16_ends;attn_protected;mlp_only' bash $here/run_s4g_rho09.sh
echo RULESDONE
