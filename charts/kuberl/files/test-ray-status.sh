deadline=$((SECONDS + TIMEOUT_S))
while :; do
  if out=$(ray status --address "$RAY_HEAD" 2>&1); then
    have=$(printf '%s\n' "$out" | awk '$2 == "GPU" { split($1, a, "/"); printf "%d\n", a[2] }' | head -n 1)
    have=${have:-0}
    if [ "$have" -eq "$WANT_GPUS" ]; then
      echo "ok: ray status reports $have GPUs, as the values ask"
      exit 0
    fi
    msg="ray status reports $have GPUs; the values ask for $WANT_GPUS"
  else
    msg="ray status cannot reach the head at $RAY_HEAD"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "FAIL: $msg (waited ${TIMEOUT_S}s)"
    printf '%s\n' "$out"
    exit 1
  fi
  sleep "${POLL_S:-10}"
done
