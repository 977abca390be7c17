
(function () {
  var t0 = performance.now();
  var data = JSON.parse(document.getElementById('report-data').textContent);
  var config = {displaylogo: false, responsive: true};
  var ids = {line: 'chart-line', steps: 'chart-steps', ranks: 'chart-ranks'};
  var jobs = [];
  Object.keys(data.figures).forEach(function (k) {
    var el = document.getElementById(ids[k]);
    var fig = data.figures[k];
    if (el && fig && window.Plotly) { jobs.push(Plotly.newPlot(el, fig.data, fig.layout, config)); }
  });
  if (!window.Plotly) { window.__reportError('plotly.js did not load'); }
  Promise.all(jobs).then(function () {
    document.body.setAttribute('data-charts', String(jobs.length));
    document.getElementById('render-ms').textContent = (performance.now()).toFixed(0);
    var paint = performance.getEntriesByName('first-contentful-paint')[0];
    document.body.setAttribute('data-first-paint-ms', paint ? paint.startTime.toFixed(0) : '');
  }, function (err) { window.__reportError('chart failed: ' + err); });

  var table = document.getElementById('top-table');
  if (!table) { return; }
  var tbody = table.tBodies[0];
  var rows = Array.prototype.slice.call(tbody.rows);
  var filter = document.getElementById('filter');
  var status = document.getElementById('status-filter');
  var count = document.getElementById('shown-count');
  function apply() {
    var q = filter.value.toLowerCase(), s = status.value, n = 0;
    rows.forEach(function (tr) {
      var ok = (!q || tr.textContent.toLowerCase().indexOf(q) >= 0) && (!s || tr.className === 'st-' + s);
      tr.style.display = ok ? '' : 'none';
      if (ok) { n++; }
    });
    count.textContent = n + ' of ' + rows.length + ' rows';
  }
  filter.addEventListener('input', apply);
  status.addEventListener('change', apply);
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    th.addEventListener('click', function () {
      var asc = th.getAttribute('data-sort') !== 'asc';
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute('data-sort'); });
      th.setAttribute('data-sort', asc ? 'asc' : 'desc');
      var numeric = th.getAttribute('data-k') === 'n';
      rows.sort(function (a, b) {
        var x = a.cells[col], y = b.cells[col], r;
        if (numeric) {
          var xv = x.getAttribute('data-v'), yv = y.getAttribute('data-v');
          if (xv === '' && yv === '') { return 0; }
          if (xv === '') { return 1; }
          if (yv === '') { return -1; }
          r = parseFloat(xv) - parseFloat(yv);
        } else {
          r = x.textContent.localeCompare(y.textContent);
        }
        return asc ? r : -r;
      });
      rows.forEach(function (tr) { tbody.appendChild(tr); });
    });
  });
  apply();
})();
