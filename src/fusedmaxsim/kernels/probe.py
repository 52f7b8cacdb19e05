"""Triton kernel of the PLAID search's probe (``fusedmaxsim.plaid.plaid_search``, step 2): each
query's candidate documents, as a bitmap, from the inverted lists of the cells it probes.

Math
----
For probed cells ``cells [Nq, P]`` (centroid ids; an id outside ``[0, n_cells)``, such as -1,
probes nothing) and inverted lists ``ivf[offsets[c] : offsets[c + 1]]`` (the documents with a
token of centroid ``c``)::

    hit[q, j] = 1   where document j is in the list of some cells[q, p]

The bitmap is zero on entry (the launcher's); the kernel only writes ones.

Grid mapping
------------
1-D grid, one program a probed cell: program ``q · P + p`` reads cell ``cells[q, p]``'s list in
steps of ``BLOCK`` ids and stores a one at each document's byte of row ``q``. A cell probed by
several tokens of a query is read once for each of them: the stores are of the same value, so the
bitmap is the same whatever order they land in (deterministic), and a query's repeats cost a few
list reads (about 300 ids a list at 100k documents), less than sorting its cells to drop them.

Caveats
-------
* ``cells`` contiguous ``[Nq, P]``, any integer type; ``offsets [n_cells + 1]`` and ``ivf [E]``
  int64, as ``PlaidIndex`` holds them. A list entry outside ``[0, n_docs)`` is skipped: never a
  store out of bounds (the index's lists are checked when it is loaded).
* ``Hit`` is the bitmap's bytes (a ``torch.bool`` tensor viewed as ``uint8``), contiguous
  ``[Nq, n_docs]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["P", "n_cells", "n_docs"])
def _probe_kernel(Cells, Offsets, Ivf, Hit, P, n_cells, n_docs, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    q = pid // P
    cell = tl.load(Cells + pid).to(tl.int64)
    probed = (cell >= 0) & (cell < n_cells)
    cell = tl.where(probed, cell, 0)
    lo = tl.load(Offsets + cell)
    hi = tl.where(probed, tl.load(Offsets + cell + 1), lo)
    row = Hit + q * n_docs
    ones = tl.full([BLOCK], 1, tl.uint8)
    for e0 in range(lo, hi, BLOCK):
        o_e = e0 + tl.arange(0, BLOCK)
        m_e = o_e < hi
        doc = tl.load(Ivf + o_e, mask=m_e, other=-1)
        tl.store(row + doc, ones, mask=m_e & (doc >= 0) & (doc < n_docs))
