"""In-process recovery: the ranks left after a lost node regroup, new ranks join, fsdp
shards are joined and sharded again."""
