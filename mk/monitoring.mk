# The chart's alert rules and Grafana dashboard (monitoring.*, docs/cluster.md "Alerts and a dashboard"):
# promtool checks and unit-tests the rules as rendered (tests/charts/test_alerts.py).

PROMTOOL     ?= bin/promtool
# Debian's `prometheus` package carries promtool; only that one file is unpacked, nothing is installed.
PROMTOOL_DEB ?= prometheus

TEST_DEPS += $(PROMTOOL)
# Under make (make test, make check-alerts) a missing promtool fails the alert tests; a bare pytest skips them.
export KUBERL_REQUIRE_PROMTOOL := 1

.PHONY: promtool check-alerts

$(PROMTOOL):
	@command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || { echo "make needs apt-get and dpkg-deb to fetch promtool from Debian's $(PROMTOOL_DEB) package: put a promtool binary (Prometheus 2.42 or later) at $(PROMTOOL) instead"; exit 2; }
	@echo "==> unpacking promtool into $(PROMTOOL) from Debian's $(PROMTOOL_DEB) package"
	@mkdir -p $(dir $(PROMTOOL))
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && chmod 755 "$$tmp" && cd "$$tmp" && \
	  { apt-get download -q=2 $(PROMTOOL_DEB) >/dev/null 2>&1 || \
	    { [ "$$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && apt-get download -q=2 $(PROMTOOL_DEB) >/dev/null 2>&1; }; } || \
	  { echo "apt-get download $(PROMTOOL_DEB) failed (as root, apt-get update first; or put promtool at $(PROMTOOL))"; exit 2; } ; \
	  dpkg-deb --fsys-tarfile "$$tmp"/$(PROMTOOL_DEB)_*.deb | tar -x -C "$$tmp" ./usr/bin/promtool && \
	  cd - >/dev/null && mv "$$tmp/usr/bin/promtool" "$(PROMTOOL).part" && mv "$(PROMTOOL).part" "$(PROMTOOL)"
	@$(PROMTOOL) --version 2>&1 | head -1

promtool: $(PROMTOOL) ## Install bin/promtool (from Debian's prometheus package, unpacked, not installed)

check-alerts: setup $(HELM) $(PROMTOOL) ## promtool check + unit tests of the chart's alert rules, and the dashboard's checks
	$(PY) -m pytest tests/charts/test_alerts.py -q -n 0 -rs
