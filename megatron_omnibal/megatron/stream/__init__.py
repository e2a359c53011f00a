"""The balanced data stream Megatron pulls: samples (real or synthetic), DataLoader workers, the
iterator, the stream's identity for resume and each step's figures."""
