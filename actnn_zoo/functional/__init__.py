"""One autograd Function per op family; each saves compressed tensors for backward."""
