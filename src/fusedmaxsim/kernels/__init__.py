"""The Triton (and Gluon) kernels of fusedmaxsim; the launchers (``fusedmaxsim._launch``) import
them. This package imports none of them, nor Triton.

* ``common``: what the kernels share: the math, the one MaxSim inner loop (``_doc_max``), query
  chunks and their scores, the one-hot product of the document-owned backwards, packed segments.
* ``forward``: the forwards, dense, packed and PLAID (residual documents decompressed on chip),
  and the inverse norms.
* ``approx``: PLAID's approximate score, a gather of centroid scores by id with a running max.
* ``probe``: the PLAID search's probe, the documents of the probed inverted lists as a bitmap.
* ``backward``: the backwards from the argmax, dense and packed: the ``grad_Q`` gathers, the
  document-owned ``grad_D`` and the drain of the atomic ``grad_D`` buffer.
* ``winner_index``: the winner index of the dense document-owned backward.
* ``smooth``: the smooth max's backward, recomputing the softmax.
* ``hopper_forward``: the large dense forward for Hopper GPUs, in Gluon.
"""
