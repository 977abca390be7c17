
(function () {
  var data = JSON.parse(document.getElementById('report-data').textContent);
  var config = {displaylogo: false, responsive: true};
  var ids = {line: 'chart-line', steps: 'chart-steps', ranks: 'chart-ranks', loss: 'chart-loss',
             grads: 'chart-grads', updates: 'chart-updates'};
  var shown = {};  // chart -> the rank or step it shows now
  var jobs = [];
  if (!window.Plotly) { window.__reportError('plotly.js did not load'); }
  Object.keys(data.figures).forEach(function (k) {
    var el = document.getElementById(ids[k]);
    var fig = data.figures[k];
    if (el && fig && window.Plotly) { jobs.push(Plotly.newPlot(el, fig.data, fig.layout, config)); }
  });
  Promise.all(jobs).then(function () {
    document.body.setAttribute('data-charts', String(jobs.length));
    document.getElementById('render-ms').textContent = (performance.now()).toFixed(0);
    var paint = performance.getEntriesByName('first-contentful-paint')[0];
    document.body.setAttribute('data-first-paint-ms', paint ? paint.startTime.toFixed(0) : '');
    var line = document.getElementById('chart-line');
    if (line && line.on) { line.on('plotly_click', function (ev) { showPoint(ev.points[0]); }); }
  }, function (err) { window.__reportError('chart failed: ' + err); });

  // rank / step pickers: the other figures were drawn ahead into data.alt
  Array.prototype.forEach.call(document.querySelectorAll('select.picker'), function (sel) {
    var k = sel.getAttribute('data-chart');
    var first = data.figures[k];
    shown[k] = sel.value;
    var initial = sel.value;
    sel.addEventListener('change', function () {
      var fig = sel.value === initial ? first : (data.alt[k] || {})[sel.value];
      if (!fig) { window.__reportError('no figure for ' + k + ' ' + sel.value); return; }
      shown[k] = sel.value;
      Plotly.react(document.getElementById(ids[k]), fig.data, fig.layout, config);
    });
  });

  // ---- the table: every compared row, filtered, sorted and paged here
  var T = data.table, C = T.cols, D = T.dicts;
  var table = document.getElementById('top-table');
  if (!table || !T) { return; }
  var tbody = table.tBodies[0];
  var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
  var cols = heads.map(function (th) { return th.getAttribute('data-c'); });
  var pageRows = parseInt(table.getAttribute('data-page-rows'), 10) || 500;
  var el = function (id) { return document.getElementById(id); };
  var filter = el('filter'), stepSel = el('step-filter'), rankSel = el('rank-filter');
  var typeSel = el('type-filter'), statusSel = el('status-filter');
  var order = [], page = 0, sortCol = null, asc = true, exactOp = null;
  cols.concat(['src', 'bound']).forEach(function (c) {  // columns that are empty in every row are left out
    if (!C[c]) { C[c] = new Array(T.n).fill(null); }
  });

  var NUMDICT = {tol: true};  // number columns sent dictionary-encoded
  function val(c, i) {
    var v = C[c][i];
    if (v === '=') { return C['t_' + c.slice(2)][i]; }
    return NUMDICT[c] && v !== null ? D[c][v] : v;
  }
  function text(c, i) {
    var v = C[c][i];
    if (v === null || v === undefined) { return ''; }
    return D[c] ? D[c][v] : v;
  }
  function num(v) {
    if (v === null || v === undefined || v === '') { return NaN; }
    if (v === 'inf') { return Infinity; }
    if (v === '-inf') { return -Infinity; }
    return typeof v === 'number' ? v : NaN;
  }
  function fmt(v) {
    if (v === null || v === undefined) { return ''; }
    if (typeof v === 'string') { return v; }
    if (v !== 0 && (Math.abs(v) < 1e-2 || Math.abs(v) >= 1e4)) { return v.toExponential(2); }
    return String(+v.toPrecision(4));
  }
  function esc(s) {
    return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');
  }
  function options(sel, values) {
    values.forEach(function (v) {
      var o = document.createElement('option'); o.value = String(v); o.textContent = String(v); sel.appendChild(o);
    });
  }
  function distinct(a) {
    var seen = {}, out = [];
    a.forEach(function (v) { if (v !== null && !seen[v]) { seen[v] = 1; out.push(v); } });
    return out.sort(function (x, y) { return x - y; });
  }
  options(stepSel, distinct(C.step));
  options(rankSel, distinct(C.rank));
  options(typeSel, D.type.slice().sort());

  function cell(c, i) {
    var v = val(c, i);
    if (c === 'err') {
      var src = text('src', i), b = C.bound[i];
      var pre = src === 'stats' && v !== null ? '≥ ' : '';
      var post = b !== null && b !== undefined && src === 'sketch' ? ' ± ' + fmt(b) : '';
      return '<td class="num" data-v="' + esc(v === null ? '' : v) + '">' + esc(pre + fmt(v) + post) + '</td>';
    }
    if (c === 'cos' || c === 'mae') {
      var est = v !== null && ['stats', 'sketch'].indexOf(text('src', i)) >= 0 ? '≈ ' : '';
      return '<td class="num">' + esc(v === null ? '' : est + fmt(v)) + '</td>';
    }
    if (D[c] && !NUMDICT[c]) { return '<td>' + esc(text(c, i)) + '</td>'; }
    return '<td class="num">' + esc(fmt(v)) + '</td>';
  }
  function draw() {
    var pages = Math.max(1, Math.ceil(order.length / pageRows));
    page = Math.min(Math.max(page, 0), pages - 1);
    var html = [];
    for (var j = page * pageRows; j < Math.min(order.length, (page + 1) * pageRows); j++) {
      var i = order[j];
      html.push('<tr class="st-' + esc(text('status', i)) + '" data-row="' + i + '">'
                + cols.map(function (c) { return cell(c, i); }).join('') + '</tr>');
    }
    tbody.innerHTML = html.join('');
    el('shown-count').textContent = order.length + ' of ' + T.n + ' rows';
    el('page-no').textContent = 'page ' + (page + 1) + ' of ' + pages;
  }
  function apply() {
    var q = filter.value.toLowerCase(), st = stepSel.value, rk = rankSel.value;
    var ty = typeSel.value, ss = statusSel.value;
    var tyCode = ty ? D.type.indexOf(ty) : -1, ssCode = ss ? D.status.indexOf(ss) : -1;
    var opHit = null, leafHit = null;
    if (exactOp !== null && q !== String(D.op[exactOp]).toLowerCase()) { exactOp = null; }  // the user typed
    if (exactOp !== null) { q = ''; }
    if (q) {
      opHit = D.op.map(function (s) { return s.toLowerCase().indexOf(q) >= 0; });
      leafHit = D.leaf.map(function (s) { return s.toLowerCase().indexOf(q) >= 0; });
    }
    order = [];
    for (var i = 0; i < T.n; i++) {
      if (st !== '' && String(C.step[i]) !== st) { continue; }
      if (rk !== '' && String(C.rank[i]) !== rk) { continue; }
      if (ty && C.type[i] !== tyCode) { continue; }
      if (ss && C.status[i] !== ssCode) { continue; }
      if (exactOp !== null && C.op[i] !== exactOp) { continue; }
      if (q && !((C.op[i] !== null && opHit[C.op[i]]) || (C.leaf[i] !== null && leafHit[C.leaf[i]])
                 || (text('op', i) + '.' + text('leaf', i)).toLowerCase().indexOf(q) >= 0)) { continue; }
      order.push(i);
    }
    if (sortCol) { sortRows(); }
    page = 0;
    draw();
  }
  function sortRows() {
    var numeric = heads[cols.indexOf(sortCol)].getAttribute('data-k') === 'n';
    order.sort(function (a, b) {
      var r;
      if (numeric) {
        var x = num(val(sortCol, a)), y = num(val(sortCol, b));
        if (isNaN(x) && isNaN(y)) { return a - b; }
        if (isNaN(x)) { return 1; }
        if (isNaN(y)) { return -1; }
        r = x - y;
      } else {
        r = text(sortCol, a).localeCompare(text(sortCol, b));
      }
      return (asc ? r : -r) || a - b;
    });
  }
  function showPoint(pt) {
    if (!pt || !pt.customdata) { return; }
    var rank = shown.line !== undefined ? shown.line : (data.figures.line.rank);
    showRows(pt.customdata[1], pt.customdata[0], rank);
  }
  // the rows of one op (its exact name, not every name containing it) at one step and rank
  function showRows(op, step, rank) {
    exactOp = op === null || op === undefined || op < 0 ? null : op;
    filter.value = exactOp === null ? '' : D.op[exactOp];
    stepSel.value = step === undefined || step === null ? '' : String(step);
    rankSel.value = rank === undefined || rank === null ? '' : String(rank);
    typeSel.value = ''; statusSel.value = '';
    apply();
    el('mismatches').scrollIntoView();
  }
  Array.prototype.forEach.call(document.querySelectorAll('a.show-rows'), function (a) {
    a.addEventListener('click', function (ev) {
      ev.preventDefault();
      showRows(D.op.indexOf(a.getAttribute('data-op')), a.getAttribute('data-step'), a.getAttribute('data-rank'));
    });
  });
  [filter].forEach(function (x) { x.addEventListener('input', apply); });
  [stepSel, rankSel, typeSel, statusSel].forEach(function (x) { x.addEventListener('change', apply); });
  el('page-prev').addEventListener('click', function () { page--; draw(); });
  el('page-next').addEventListener('click', function () { page++; draw(); });
  heads.forEach(function (th) {
    th.addEventListener('click', function () {
      var c = th.getAttribute('data-c');
      asc = sortCol === c ? !asc : true;
      sortCol = c;
      heads.forEach(function (h) { h.removeAttribute('data-sort'); });
      th.setAttribute('data-sort', asc ? 'asc' : 'desc');
      sortRows();
      page = 0;
      draw();
    });
  });
  apply();
})();
