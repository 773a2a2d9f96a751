"""Context parallelism: the sequence split over cp ranks (``layout``), blockwise attention with
log-sum-exp merging (``kernels``) and the attention that exchanges keys and values between the ranks
(``attention``: ring ``p2p``, ``a2a``, ``allgather``, ``a2a+p2p``)."""
