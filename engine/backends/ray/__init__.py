"""`--data-parallel-backend ray`: DP ranks as Ray actors in one placement group
(placement: the pre-start check and the placement child; rank: the per-rank proxy child)."""
