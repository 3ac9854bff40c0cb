"""fused_dlrm: computation fused with its dependent collective, for DLRM and MoE training."""
