"""Rendezvous backends registered with torch.distributed.elastic (``--rdzv-backend etcd3``)."""
