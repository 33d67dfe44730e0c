"""The jobs of a physical plan: one class per thing a pass does with its chunks, each
with its accumulator, in a module of this package (:mod:`~gradalg.plan.jobs.base` holds
the :class:`Job` base and the :class:`Accumulator` protocol).

=============  ==============================================  ========================
class          reads                                            produces
=============  ==============================================  ========================
CollectJob     every row of ``target`` (a held side)            rows (list of chunks)
StoreJob       rows a later pass needs after this pass's        rows (list of chunks)
               statistics (the store-vs-recompute decision)
GroupJob       rows of ``target.grads``                         group means (rows)
FisherJob      rows of the Fisher's gradients                   (1/n) Σ g gᵀ, resolved
KFACJob        factors of the gradients                         Kronecker eigenbases
EKFACJob       factors, and the KFACJob's eigenbases            corrected eigenvalues
ScoresJob      the streamed side; the held side (collected)     (n_left, n_right) scores
TopKJob        its terms' streamed sides; their held sides      (n_query, k) best scores
                                                                and training positions
DiagJob        both sides in lockstep (or one, the other held)  (n,) self-scores
ApplyJob       an operator's rows, once (DataInf)               H⁻¹ (a score's held rows)
ProductsJob    raw batches of a curvature's data, once per      V ↦ H V (a matvec), for
               call (CG / LiSSA / Arnoldi iterations)           an iterative solver
=============  ==============================================  ========================
"""
from .apply import AppliedSums, ApplyJob, held_application
from .base import JOB_TYPES, Accumulator, Job, job_type
from .fisher import FisherAccumulator, FisherJob
from .products import ProductPass, ProductsJob, ProductSums
from .kron import EKFACAccumulator, EKFACJob, KFACJob, KronAccumulator, KronStatisticsJob
from .rows import CollectJob, Collector, GroupAccumulator, GroupJob, RowsJob, StoreJob
from .scores import DiagAccumulator, DiagJob, ScoreAccumulator, ScoresJob, blockwise_preconditioner
from .topk import TopK, TopKAccumulator, TopKJob, select_topk

__all__ = ["Job", "Accumulator", "JOB_TYPES", "job_type", "RowsJob", "CollectJob", "StoreJob", "GroupJob",
           "FisherJob", "KronStatisticsJob", "KFACJob", "EKFACJob", "ScoresJob", "DiagJob", "TopK", "TopKJob",
           "blockwise_preconditioner", "Collector", "GroupAccumulator", "FisherAccumulator", "KronAccumulator",
           "EKFACAccumulator", "ScoreAccumulator", "DiagAccumulator", "TopKAccumulator", "select_topk", "ApplyJob", "AppliedSums", "held_application",
           "ProductsJob", "ProductSums", "ProductPass"]
