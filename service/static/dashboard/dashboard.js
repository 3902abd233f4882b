/* pipeplan dashboard: tooltips, zoom, live updates (EventSource), refine/cancel. No dependencies. */
(function () {
  "use strict";
  var KEY_STORE = "pipeplan.apiKey";
  var body = document.body;
  var base = body.getAttribute("data-base") || "/dashboard";

  function apiKey() { try { return localStorage.getItem(KEY_STORE) || ""; } catch (e) { return ""; } }
  function authHeaders() {
    var h = { "Content-Type": "application/json" };
    var k = apiKey();
    if (k) { h["X-API-Key"] = k; h["Authorization"] = "Bearer " + k; }
    return h;
  }

  /* When the service key-gates reads, page loads carry the key as a same-site cookie. */
  function setKeyCookie(k) {
    document.cookie = "pipeplan_api_key=" + encodeURIComponent(k) + "; path=/; SameSite=Strict" +
      (k ? "" : "; max-age=0");
  }
  if (apiKey() && document.cookie.indexOf("pipeplan_api_key=") < 0) { setKeyCookie(apiKey()); }

  /* API key box: stored in this browser only, sent with refine / cancel. */
  var keyInput = document.getElementById("api-key");
  if (keyInput) {
    keyInput.value = apiKey();
    keyInput.addEventListener("change", function () {
      var k = keyInput.value.trim();
      try { localStorage.setItem(KEY_STORE, k); } catch (e) { /* private mode */ }
      setKeyCookie(k);
      if (document.getElementById("locked")) { window.location.reload(); }
    });
  }

  /* One tooltip, one delegated handler for every chart: a 10k-op Gantt adds no listeners. */
  var tip = document.createElement("div");
  tip.id = "tip";
  document.body.appendChild(tip);
  var KIND_NAMES = { F: "forward", B: "backward (input)", W: "backward (weight)", BW: "backward (full)",
    RECOMPUTE: "recompute", OFFLOAD: "offload (device→host)", RELOAD: "reload (host→device)" };
  function fmt(v) { var n = parseFloat(v); return (Math.round(n * 1000) / 1000).toString(); }
  function tipHtml(el) {
    var o = el.getAttribute("data-o");
    if (!o) { return null; }
    if (!el.classList.contains("op")) { return document.createTextNode(o); }
    var p = o.split(",");
    var dur = parseFloat(p[4]) - parseFloat(p[3]);
    var frag = document.createElement("span");
    var sw = document.createElement("i"); sw.className = "k";
    sw.style.background = getComputedStyle(el).fill;
    var title = document.createElement("b"); title.textContent = p[0] + "  stage " + p[1] + " · mb " + p[2];
    frag.appendChild(sw); frag.appendChild(title);
    frag.appendChild(document.createElement("br"));
    frag.appendChild(document.createTextNode((KIND_NAMES[p[0]] || p[0])));
    frag.appendChild(document.createElement("br"));
    frag.appendChild(document.createTextNode(fmt(p[3]) + " → " + fmt(p[4]) + " ms  (" + fmt(dur) + " ms)"));
    return frag;
  }
  var current = null;
  document.addEventListener("mousemove", function (ev) {
    var el = ev.target;
    if (!(el instanceof Element) || !el.hasAttribute("data-o")) {
      if (current) { current = null; tip.style.display = "none"; }
      return;
    }
    if (el !== current) {
      current = el;
      var content = tipHtml(el);
      tip.textContent = "";
      if (content) { tip.appendChild(content); }
      tip.style.display = "block";
    }
    var x = ev.clientX + 14, y = ev.clientY + 14;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 8) { x = ev.clientX - w - 10; }
    if (y + h > window.innerHeight - 8) { y = ev.clientY - h - 10; }
    tip.style.left = x + "px"; tip.style.top = y + "px";
  });
  document.addEventListener("mouseleave", function () { tip.style.display = "none"; current = null; });

  /* Live updates. The server sends one event per new revision or job state change; the page
     re-fetches only the server-rendered fragment that changed (one table row, or the plan panels). */
  var liveDot = document.getElementById("live-dot"), liveStatus = document.getElementById("live-status");
  function setLive(on, text) {
    if (liveDot) { liveDot.classList.toggle("on", on); }
    if (liveStatus) { liveStatus.textContent = text; }
  }
  function listen(url, onEvent) {
    if (!window.EventSource) { setLive(false, "no live updates"); return; }
    var es = new EventSource(url);
    es.onopen = function () { setLive(true, "live"); };
    es.onerror = function () { setLive(false, "reconnecting…"); };
    ["revision", "job", "message"].forEach(function (name) {
      es.addEventListener(name, function (ev) {
        var data = null;
        try { data = JSON.parse(ev.data); } catch (e) { data = {}; }
        onEvent(name, data || {});
      });
    });
    window.addEventListener("beforeunload", function () { es.close(); });
  }

  var overview = document.getElementById("plans-table");
  if (overview) {
    var refreshRow = function (key, flash) {
      var row = document.getElementById("row-" + key);
      if (!row) { return Promise.resolve(); }  /* not on this page: keep the server-side order */
      return fetch(base + "/rows/" + encodeURIComponent(key), { headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) { return; }
          var t = document.createElement("tbody");
          t.innerHTML = html.trim();
          var fresh = t.firstElementChild;
          var current = document.getElementById("row-" + key);
          if (!fresh || !current) { return; }
          if (flash) { fresh.classList.add("flash"); }
          current.replaceWith(fresh);
        });
    };
    var notice = document.getElementById("new-notice");
    listen(base + "/events", function (name, data) {
      if (!data.key) { return; }
      if (document.getElementById("row-" + data.key)) { refreshRow(data.key, true); }
      else if (notice && name === "revision") { notice.hidden = false; }
    });
    /* Rows whose 1F1B figure was not computed within the page's time budget: fill them in, one at a
       time so a page of new configurations does not flood a 2-core server. */
    var pending = Array.prototype.map.call(document.querySelectorAll("tr[data-pending]"),
                                           function (tr) { return tr.getAttribute("data-key"); });
    var next = function () { if (pending.length) { refreshRow(pending.shift(), false).then(next, next); } };
    next();
  }

  var planPage = document.getElementById("plan-page");
  if (planPage) {
    var loadBaselines = function () {};
    var key = planPage.getAttribute("data-key");
    var loading = false, again = false;
    var refreshLive = function () {
      if (loading) { again = true; return; }
      loading = true;
      var pinned = planPage.getAttribute("data-pinned");
      fetch(base + "/plans/" + encodeURIComponent(key) + "/live?zoom=" + zoomLevel() +
            (pinned ? "&revision=" + encodeURIComponent(pinned) : ""), { headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html) {
            var budgetBox = document.getElementById("refine-budget");
            var budget = budgetBox ? budgetBox.value : null;
            var msgBox = document.getElementById("action-msg");
            var said = msgBox ? [msgBox.textContent, msgBox.className] : null;
            var scrolled = (document.getElementById("gantt") || {}).scrollLeft || 0;
            document.getElementById("plan-live").innerHTML = html;
            ["gantt", "memory"].forEach(function (id) {
              var el = document.getElementById(id);
              if (el) { el.scrollLeft = scrolled; }
            });
            if (budget !== null && document.getElementById("refine-budget")) {
              document.getElementById("refine-budget").value = budget;
            }
            if (said && document.getElementById("action-msg")) {
              document.getElementById("action-msg").textContent = said[0];
              document.getElementById("action-msg").className = said[1];
            }
            loadBaselines();
            var rev = document.getElementById("m-revision");
            if (rev) { planPage.setAttribute("data-revision", rev.textContent.trim()); }
          }
        })
        .finally(function () { loading = false; if (again) { again = false; refreshLive(); } });
    };
    var jobBadge = document.getElementById("job-state");
    listen(base + "/events?key=" + encodeURIComponent(key) + "&rev=" +
           encodeURIComponent(planPage.getAttribute("data-revision") || "0") +
           (jobBadge && jobBadge.textContent.trim() !== "none" ? "&state=" + encodeURIComponent(jobBadge.textContent.trim()) : ""),
           function (name, data) {
      var shown = parseInt(planPage.getAttribute("data-revision") || "0", 10);
      if (name === "revision" && data.revision && data.revision > shown) {
        planPage.setAttribute("data-revision", data.revision);
      }
      refreshLive();
    });

    /* Zoom re-draws the charts on the server at 2×, 4×, … the width (time axis only, text stays
       sharp) inside a scrolling box; the view stays centred on the same instant. */
    var ZOOMS = [1, 2, 4, 8, 16, 32];
    var zoomLevel = function () {
      var z = document.querySelector(".zoom[data-zoom-level]");
      return z ? parseInt(z.getAttribute("data-zoom-level"), 10) : 1;
    };
    var zooming = false;
    document.addEventListener("click", function (ev) {
      var b = ev.target.closest && ev.target.closest("[data-zoom]");
      if (!b || zooming) { return; }
      var cur = zoomLevel(), i = ZOOMS.indexOf(cur), what = b.getAttribute("data-zoom");
      var next = what === "fit" ? 1 : ZOOMS[Math.max(0, Math.min(ZOOMS.length - 1, i + (what === "in" ? 1 : -1)))];
      if (next === cur) { return; }
      var scroller = document.getElementById("gantt");
      var centre = scroller ? (scroller.scrollLeft + scroller.clientWidth / 2) / scroller.scrollWidth : 0.5;
      zooming = true;
      fetch(base + "/plans/" + encodeURIComponent(key) + "/charts?zoom=" + next + "&revision=" +
            encodeURIComponent(planPage.getAttribute("data-revision") || ""), { headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) { return; }
          document.getElementById("charts").innerHTML = html;
          ["gantt", "memory"].forEach(function (id) {
            var el = document.getElementById(id);
            if (el) { el.scrollLeft = Math.max(0, centre * el.scrollWidth - el.clientWidth / 2); }
          });
        })
        .finally(function () { zooming = false; });
    });
    /* The Gantt and memory plots scroll together. */
    document.addEventListener("scroll", function (ev) {
      var t = ev.target;
      if (!t || !t.id || (t.id !== "gantt" && t.id !== "memory")) { return; }
      var other = document.getElementById(t.id === "gantt" ? "memory" : "gantt");
      if (other && Math.abs(other.scrollLeft - t.scrollLeft) > 1) { other.scrollLeft = t.scrollLeft; }
    }, true);

    /* The baselines table of a problem seen for the first time: computed by its own request, then
       the live panels are re-fetched (they now carry the table and the 1F1B figure). */
    var baselinesAsked = false;
    loadBaselines = function () {
      var box = document.getElementById("baselines-box");
      if (!box || !box.hasAttribute("data-pending") || baselinesAsked) { return; }
      baselinesAsked = true;
      fetch(base + "/plans/" + encodeURIComponent(key) + "/baselines", { headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          var now = document.getElementById("baselines-box");
          if (html && now) { now.innerHTML = html; now.removeAttribute("data-pending"); }
          refreshLive();
        });
    };
    loadBaselines();

    var say = function (text, err) {
      var msg = document.getElementById("action-msg");
      if (msg) { msg.textContent = text; msg.classList.toggle("err", !!err); }
    };
    var post = function (path, payload, okText) {
      say("sending…", false);
      fetch("/v1/plans/" + encodeURIComponent(key) + "/" + path,
            { method: "POST", headers: authHeaders(), body: JSON.stringify(payload || {}) })
        .then(function (r) {
          return r.text().then(function (t) {
            var detail = "";
            try { var j = JSON.parse(t); detail = j.detail || j.message || j.error || ""; } catch (e) { detail = t; }
            if (typeof detail !== "string") { detail = JSON.stringify(detail); }
            if (r.status === 401 || r.status === 403) { say("API key required or rejected (set it at the top right)", true); }
            else if (!r.ok) { say("error " + r.status + (detail ? ": " + detail : ""), true); }
            else { say(okText, false); refreshLive(); }
          });
        })
        .catch(function (e) { say("request failed: " + e, true); });
    };
    document.addEventListener("click", function (ev) {
      var b = ev.target.closest && ev.target.closest("[data-action]");
      if (!b) { return; }
      if (b.getAttribute("data-action") === "refine") {
        var budget = parseFloat((document.getElementById("refine-budget") || {}).value || "30");
        post("refine", { time_budget_s: budget }, "refine job queued (" + budget + " s)");
      } else if (b.getAttribute("data-action") === "cancel") {
        post("cancel", {}, "cancel requested");
      }
    });
  }
})();
